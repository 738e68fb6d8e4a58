"""A tokenizer.json made with the `tokenizers` library trains llama3_debug (train.py, one process), and the
model's vocabulary is the tokenizer's."""
from __future__ import annotations

import math
import re

from _cli import TINY
from _hf_tokenizer import llama3_style_tokenizer, write_model_folder


def test_hf_tokenizer_folder_trains_llama3_debug(cli, tmp_path):
    # 2300 ids: more than the debug flavor's 2048 rows, so the embedding must grow to exactly the tokenizer's size.
    library = llama3_style_tokenizer(2300)
    folder = write_model_folder(tmp_path / "tok", library)
    result = cli(["--config", "llama3_debug", "--tokenizer.path", str(folder), "--training.steps", "3", *TINY,
                  "--job.dump_folder", str(tmp_path / "out")], launcher="train.py")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    vocab = library.get_vocab_size(with_added_tokens=True)
    assert vocab == 2300
    logged = re.search(r"tokenizer: .*tokenizer\.json \(hf, vocabulary (\d+), bos=0 '<\|begin_of_text\|>', eos=1 "
                       r"'<\|end_of_text\|>'\); model vocabulary (\d+)", out)
    assert logged, out[-3000:]
    assert (int(logged.group(1)), int(logged.group(2))) == (vocab, vocab)
    losses = [float(x) for x in re.findall(r"step +\d+\S*  \S*loss +([\d.]+)", out)]
    # A fresh model starts near ln(2300) = 7.74 nats: it sees tokens of the whole vocabulary. The spread of
    # the initial logits adds up to ~0.8 nats on top, and the tokenizer is trained on the project's own
    # sources, so the exact figure moves with every change of them: 1 nat either side of ln(2300).
    assert len(losses) == 3 and abs(losses[0] - math.log(vocab)) < 1.0, out[-3000:]
