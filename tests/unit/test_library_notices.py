"""torch / torchao start-up notices that are expected on this machine are filtered, and only those."""
import logging
import subprocess
import sys

from torchtitan_lite.library_notices import _not_pytree_enum_notice


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, message, None, None)


def test_only_the_pytree_enum_notice_is_dropped():
    assert not _not_pytree_enum_notice(_record(
        "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile"))
    assert _not_pytree_enum_notice(_record("some other pytree warning"))


def test_importing_torchao_after_silencing_prints_neither_notice():
    code = ("from torchtitan_lite.library_notices import silence_known_library_notices\n"
            "silence_known_library_notices()\n"
            "import torchao.float8\n"
            "print('imported')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"
    assert "is an Enum subclass" not in done.stderr
    assert "Failed to load" not in done.stderr  # no CUDA here, so torchao's kernel notices are hidden

