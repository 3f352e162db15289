"""``python -m kvabi_vllm.tools.checkpoints PATH`` writes a checkpoint with a byte tokenizer
that round-trips any text and whose special tokens sit at the ids the config names (the
serving tests then send it text and chat messages through vLLM's own server)."""
import json

from transformers import AutoTokenizer

from kvabi_vllm.tools import checkpoints as ck


def test_the_command_writes_a_model_and_a_byte_tokenizer(tmp_path, capsys):
    assert ck.main([str(tmp_path / "m"), "--layers", "2"]) == 0
    assert "wrote a random llama-like checkpoint (2 layers" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tok) == ck.TOKENIZER_VOCAB <= cfg["vocab_size"]
    text = "Hello, wörld! \u2603 kvabi"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text  # one token per byte
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == \
        (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"])
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "user: hi\nassistant:"
