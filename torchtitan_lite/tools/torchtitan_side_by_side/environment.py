"""torchtitan's side of the machine: its own virtual environment, its tokenizer, and our training
shards where its JSON loader reads them."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from torchtitan_lite.tools.repo import SCRIPTS_DIR


def ensure_venv(venv: Path, torchtitan_version: str) -> tuple[Path, dict[str, str]]:
    """torchtitan's interpreter (the environment is created or fixed when needed) and its versions."""
    import torch

    from torchtitan_lite.tools.benchmark.run_info import package_version

    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    # torchao at our version: torchtitan's float8 converter builds torchao's Float8Linear, as ours does.
    wanted = {"torchtitan": torchtitan_version, "torch": torch_version, "torchao": package_version("torchao")}
    if not python.exists():
        print(f"creating {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    versions = _installed(python)
    if any(not versions.get(name, "").startswith(version) for name, version in wanted.items()) or "triton" not in versions:
        # torch pinned to ours: an unpinned resolve would pull a multi-GB CUDA build onto a CPU machine.
        cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               *(f"{name}=={version}" for name, version in wanted.items()), "triton"]
        print("installing: " + shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        versions = _installed(python)
    return python, versions


def _installed(python: Path) -> dict[str, str]:
    probe = ("import importlib.metadata as m, json\nout = {}\nfor name in ('torchtitan', 'torch', 'torchao', 'triton'):\n"
             "    try: out[name] = m.version(name)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def torchtitan_float8_recipes(python: Path) -> list[str]:
    """The float8 recipe names the installed torchtitan's converter accepts (read off its config's type)."""
    probe = ("import json, typing\nfrom torchtitan.components.quantization import Float8LinearConverter\n"
             "hints = typing.get_type_hints(Float8LinearConverter.Config)\n"
             "print(json.dumps(list(typing.get_args(hints['recipe_name']))))")
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: could not read torchtitan's float8 recipes:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def ensure_tokenizer(python: Path, out_dir: Path, vocab_size: int, data_dir: Path) -> Path:
    """torchtitan's byte-level BPE with ``vocab_size`` pieces in ``out_dir``, trained on the shards unless present."""
    config = out_dir / "tokenizer.json"
    if config.exists() and len(json.loads(config.read_text())["model"]["vocab"]) == vocab_size:
        return out_dir
    print(f"training torchtitan's tokenizer ({vocab_size} pieces) on the same shards", flush=True)
    shards = sorted(str(p) for p in data_dir.iterdir())
    subprocess.run([str(python), str(SCRIPTS_DIR / "_torchtitan_cpu.py"), "tokenizer", str(out_dir), str(vocab_size),
                    *shards], check=True)
    return out_dir


def link_training_shards(data_dir: Path) -> Path:
    """A folder holding (links to) our embedded corpus's training shards, for torchtitan's JSON loader."""
    from torchtitan_lite.components.data.corpus import embedded_corpus

    data_dir.mkdir(parents=True, exist_ok=True)
    for old in data_dir.iterdir():
        old.unlink()
    for shard in embedded_corpus().train_files:
        (data_dir / Path(shard).name).symlink_to(shard)
    return data_dir
