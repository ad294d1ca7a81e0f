import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.dirname(__file__))  # the helpers package: tests/helpers

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests check behaviour, not speed: one thread avoids oversubscribing small CPU machines
# (a tiny UNet forward takes ~15x longer with 2 threads when other processes compete).
# TOMERGE_TEST_THREADS and TOMERGE_TEST_MKLDNN=0 change how float32 kernels round, as another machine
# would: .ci/run reruns the tie_sensitive tests so (see docs/strategies.md, "Float32 ties change plans").
torch.set_num_threads(int(os.environ.get("TOMERGE_TEST_THREADS", "1")))
if os.environ.get("TOMERGE_TEST_MKLDNN", "1") == "0":
    torch.backends.mkldnn.enabled = False


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "tie_sensitive: compares discrete choices (argmax, sorts, greedy picks) or batched/compiled results "
        "exactly; .ci/run reruns these with other kernel rounding (ATEN_CPU_CAPABILITY=default, 2 threads)",
    )
    config.addinivalue_line(
        "markers",
        "fake_cuda: runs real-size models on fake CUDA tensors (FakeTensorMode) as the GPU's stand-in: device, "
        "dtype and shape errors, host reads, the bytes tomerge keeps (tests/fake_cuda)",
    )


@pytest.fixture(scope="module")
def models():
    """The declared families' models by row name (``helpers.families.FAMILIES``), each built on first use in the
    module (a module may define its own ``models``)."""
    from helpers.families import Models

    return Models()
