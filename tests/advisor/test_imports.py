"""``import lightning_dlrover`` stays cheap: scipy and SQLAlchemy load only when a model is fitted or a history
opened."""

import subprocess
import sys

from tests.conftest import REPO


def test_package_import_leaves_scipy_and_sqlalchemy_unloaded():
    code = ("import sys, lightning_dlrover\n"
            "loaded = lambda: sorted(m for m in ('scipy', 'sqlalchemy') if m in sys.modules)\n"
            "print(loaded())\n"
            "from lightning_dlrover.advisor import JobHistory\n"
            "print(loaded())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "['sqlalchemy']"]  # the history module, once asked for
