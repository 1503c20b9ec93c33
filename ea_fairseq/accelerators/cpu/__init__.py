"""CPU accelerators (a C++ extension built on first use, see :mod:`.build`)."""
