"""What the test modules share and are not tests themselves: the attention families
(``support.families``), models built and checkpoints trained for the tests, the recipes' stand-in
archives, the crafted checkpoints of the loading guard's tests, ... Imported as ``support.<module>``
(tests/ is on ``sys.path``: pytest puts tests/conftest.py's folder there). The scripts the tests
run as processes are in tests/drivers, the committed data in tests/fixtures."""
