"""Fixtures of the tests/daemon/test_qmoed_*.py suites: the banks (generated
once per module by `qmoe-bank create`) and a daemon serving the small one,
which must exit 0 when the module is done.
"""
import os
import tempfile

import pytest

from qmoed_harness import Daemon, make_bank


@pytest.fixture(scope="module")
def banks():
    d = tempfile.mkdtemp(prefix="qmoed-banks-")
    return {
        "small": make_bank(os.path.join(d, "small.bank")),
        # no router weight: router_logits become mandatory
        "norouter": make_bank(os.path.join(d, "norouter.bank"), router=False, seed=2,
                              activation="silu", fusion=0, bits=8, block=0),
        "dir": d,
    }


@pytest.fixture(scope="module")
def daemon(banks):
    dm = Daemon(models={"small": banks["small"]})
    yield dm
    assert dm.stop() == 0, dm.log_text()
