"""The setup bench/hook's scripts share: the import paths of the client
package and the daemon harness, their common arguments, and the bank made
from a tiny fixture model (tests/import/fixtures) by `qmoe-bank import hf`."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "daemon"))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))


def add_common_args(ap, fixture, tokens):
    """--build, --fixture, --tokens and --rounds, with these defaults."""
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--fixture", default=fixture)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--rounds", type=int, default=5)


def parse(ap):
    """The arguments; QMOE_BUILD_DIR set from --build before the daemon
    harness is imported (it reads it then)."""
    a = ap.parse_args()
    os.environ["QMOE_BUILD_DIR"] = a.build
    return a


def fixture_bank(name, workdir):
    """The fixture model's folder, and an 8-bit bank imported from it into
    workdir: (fixture, bank)."""
    from qmoed_harness import qmoe_bank_path
    fixture = os.path.join(ROOT, "tests", "import", "fixtures", name)
    bank = os.path.join(workdir, name + ".bank")
    subprocess.run([qmoe_bank_path(), "import", "hf", fixture, "--out", bank, "--bits", "8",
                    "--quiet"], check=True)
    return fixture, bank
