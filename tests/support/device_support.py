"""What the device suite (tests/device/test_device*.py) shares: the test device's marker for what
needs CUDA, the small models of every family cast as fairseq casts them, the precisions' bounds,
float32 without TF32, and the report of measurements (``EA_FAIRSEQ_DEVICE_REPORT=<file>``
appends them, as JSON lines, to ``<file>``)."""
import json
import os

import pytest
import torch

from conftest import DEVICE, ON_CUDA, build_model
from support.families import ANCHORED, FAMILIES


def needs_cuda(what: str):
    """Marks a test ``cuda`` and skips it, saying why, where the test device is not CUDA."""
    def mark(test):
        return pytest.mark.cuda(pytest.mark.skipif(not ON_CUDA, reason=f"{what} needs CUDA (the test device is "
                                                                       f"{DEVICE})")(test))
    return mark


SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0", "--attention-dropout", "0.0",
         "--activation-dropout", "0.0")

# Two computations of the same logits on the device (float32: TF32 is switched off below;
# kernels still pick a reduction order per shape; the bounds of test_decoding_properties.py)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.1}
# EA/PA switched off vs fairseq's transformer: float64 as on CPU (test_ea_exactness.py)
REDUCTION = {torch.float64: 1e-6, **TOLERANCE}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                                 ids=["fp32", "fp16", "bf16"])
EVERY_FAMILY = pytest.mark.parametrize("family", ANCHORED)

@pytest.fixture(autouse=True)
def exact_float32():
    """float32 means float32: no TF32 in matmuls or in cuDNN's (EA's, PA's) convolutions."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


def report(name: str, **values):
    """A measurement: printed, and appended to ``$EA_FAIRSEQ_DEVICE_REPORT`` when set."""
    line = json.dumps({"measurement": name, "device": str(DEVICE),
                       "device_name": torch.cuda.get_device_name(DEVICE) if ON_CUDA else "cpu", **values})
    print(line)
    path = os.environ.get("EA_FAIRSEQ_DEVICE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def cast(model, dtype):
    """As fairseq's ``--fp16``/``--bf16`` cast a model (``.half()``/``.bfloat16()``)."""
    return {torch.float16: model.half, torch.bfloat16: model.bfloat16, torch.float32: model.float,
            torch.float64: model.double}[dtype]()


def family_model(family, dtype=torch.float32, device=DEVICE, *extra):
    model, _ = build_model(*FAMILIES[family].args(), *SMALL, *extra)
    FAMILIES[family].perturbed(model, *SMALL)  # (the same values on every call: the float64 copy's too)
    return cast(model, dtype).to(device).eval()

def twin_arch(family: str) -> str:
    """fairseq's own transformer at the family's size: the yardstick of its precision."""
    return "transformer" if FAMILIES[family].arch.endswith("_base") else "transformer_lite"
