"""P/D options where they enter, before any engine runs: ``use(..., pd=...)``,
``kvabi-transformers serve``'s command line and the fields an HTTP request adds."""
import pytest

import kvabi_transformers
from kvabi import KVABIError
from kvabi.pd import PDSettings
from kvabi_transformers.connector.settings import pd_options
from kvabi_transformers.serving import serve
from kvabi_transformers.serving.routes import read_ask

from tf_cases import model_of, model_state


@pytest.mark.parametrize("given, role", [
    ("kv_producer", "producer"), ("consumer", "consumer"), ({"kv_role": "kv_both"}, "both"),
    ({"role": "producer"}, "producer"), (PDSettings(role="consumer"), "consumer")])
def test_roles_in_vllms_words_and_the_protocols(given, role):
    assert pd_options(given).settings.role == role


def test_the_extra_config_is_read_like_vllms():
    o = pd_options({"kv_connector": "KvabiConnector", "kv_role": "kv_consumer",
                    "kv_connector_extra_config": {"pull_timeout_s": 3, "max_pulls": 2,
                                                  "engine_id": "tf_1", "max_model_len": 64,
                                                  "kv_load_failure_policy": "recompute"}})
    assert (o.settings.pull_timeout_s, o.settings.max_pulls) == (3.0, 2)
    assert (o.engine_id, o.max_model_len, o.failure_policy) == ("tf_1", 64, "recompute")


@pytest.mark.parametrize("given, field", [
    (3, "pd"), ({"kv_role": "decoder"}, "pd.kv_role"), ({"pull_timeout": 3}, "pd.pull_timeout"),
    ({"kv_connector_extra_config": []}, "pd.kv_connector_extra_config"),
    ({"pull_timeout_s": -1}, "pull_timeout_s"), ({"engine_id": "a b"}, "pd.engine_id"),
    ({"max_model_len": 0}, "pd.max_model_len"),
    ({"kv_load_failure_policy": "ignore"}, "pd.kv_load_failure_policy")])
def test_bad_options_are_refused_by_field_and_leave_the_model_as_it_was(given, field):
    with pytest.raises(KVABIError, match=f"^{field}"):
        pd_options(given)
    model = model_of("llama")
    before = model_state(model)
    with pytest.raises(KVABIError, match=f"^{field}"):
        kvabi_transformers.use(model, pd=given)
    assert model_state(model) == before


def test_kv_transfer_params_without_pd_are_refused():
    from transformers import GenerationConfig

    model = kvabi_transformers.use(model_of("llama"))
    mgr = model.init_continuous_batching(generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=-1))
    with pytest.raises(KVABIError, match="^kv_transfer_params: this model is not set up"):
        mgr.add_request([5, 6, 7], request_id="x", kv_transfer_params={})


def test_an_http_request_s_own_fields():
    body = {"prompt": "hi", "kv_transfer_params": {"a": 1}, "ignore_eos": True,
            "return_token_ids": False}
    ask = read_ask(body, "r1")
    assert body == {"prompt": "hi"}  # transformers' handler sees its own fields only
    assert (ask.request_id, ask.kv_transfer_params, ask.ignore_eos, ask.return_token_ids) == \
        ("r1", {"a": 1}, True, False)
    with pytest.raises(KVABIError, match="^ignore_eos"):
        read_ask({"ignore_eos": "yes"}, "r2")


@pytest.mark.parametrize("argv, words", [
    (["m", "--no-continuous-batching"], "--no-continuous-batching: kvabi serves continuous"),
    (["m", "--cb-num-blocks", "8"], "--cb-num-blocks: the cache is sized by --kvabi-memory"),
    (["m", "--kv-transfer-config", "{oops"], "--kv-transfer-config: not JSON"),
    (["m", "--kv-transfer-config", '{"kv_role": "x"}'], "pd.kv_role"),
    (["m", "--kvabi-block-size", "big"], "--kvabi-block-size: must be an integer")])
def test_serve_refuses_what_it_cannot_serve_before_loading_anything(argv, words, capsys):
    assert serve.main(argv) == 2
    assert words in capsys.readouterr().err
