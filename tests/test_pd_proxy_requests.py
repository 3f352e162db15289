"""The P/D proxy (``kvabi proxy``) without servers: what it reads of a request body and what
it refuses (every body a 400 naming what is wrong, never an exception from deep in a parser),
and its release of a grant it will not hand over: the notification a decode engine sends,
over NIXL to a producer's grant table, which releases the live grant once (a second one
for the same grant changes nothing and is told apart from a forged one)."""
import json

import pytest

import numpy as np

from kvabi.pd.grants import GrantTable
from kvabi.pd.http import HTTPError
from kvabi.pd.notify import parse_notification
from kvabi.pd.proxy import check_body
from kvabi.pd.record import LIVE, GrantRecord, PartClaim, record_bytes
from kvabi.pd.release import GrantReleaser


@pytest.mark.parametrize("raw, says", [
    (b"[" * 100_000 + b"]" * 100_000, "request body: nested 100000 deep"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "request body: nested 5000 deep"),
    (b'{"prompt": "a", "prompt": "b"}', "request body: duplicate key 'prompt'"),
    (b'{"temperature": NaN}', "request body: NaN"),
    (b'{"prompt": "\xff"}', "request body: not UTF-8"),
    (b'\xef\xbb\xbf{"prompt": "a"}', "request body: starts with a byte-order mark"),
    (b'{"prompt": ', "request body: not valid JSON"),
    (b'[1, 2]', "request body: must be a JSON object, got list"),
    (b'"text"', "request body: must be a JSON object, got str"),
    (b'{"max_tokens": ' + b"9" * 30 + b"}", "request body"),
])
def test_every_body_is_read_or_refused_naming_what_is_wrong(raw, says):
    with pytest.raises(HTTPError) as e:
        check_body(raw)
    assert e.value.status == 400 and str(e.value).startswith(says), str(e.value)


@pytest.mark.parametrize("body, says", [
    ({"prompt": ["a", "b"]}, "prompt: a batch of 2 prompts"),
    ({"prompt": [[1, 2], [3]]}, "prompt: a batch of 2 prompts"),
    ({"prompt_embeds": ["x", "y", "z"]}, "prompt_embeds: a batch of 3 prompts"),
    ({"prompt": "a", "n": 2}, "n: 2: "),
    ({"prompt": "a", "n": True}, "n: True: "),
    ({"prompt": "a", "n": "1"}, "n: '1': "),
    ({"prompt": "a", "use_beam_search": True}, "use_beam_search: "),
    ({"prompt": "a", "use_beam_search": "no"}, "use_beam_search: "),
    ({"prompt": "a", "stream": "false"}, "stream: must be true or false, got 'false'"),
    ({"prompt": "a", "stream": 0}, "stream: must be true or false, got 0"),
])
def test_what_one_prefill_cannot_hand_over_whole_is_refused_by_field(body, says):
    with pytest.raises(HTTPError) as e:
        check_body(json.dumps(body).encode())
    assert e.value.status == 400 and str(e.value).startswith(says), str(e.value)


@pytest.mark.parametrize("body", [
    {"prompt": "a"}, {"prompt": ["a"]}, {"prompt": [1, 2, 3]}, {"prompt": [[1, 2]]},
    {"prompt": "a", "n": 1, "stream": True, "use_beam_search": False},
    {"messages": [{"role": "user", "content": "hi"}], "n": None, "stream": None},
])
def test_one_prompt_one_sequence_passes(body):
    assert check_body(json.dumps(body).encode()) == body


def _record(nonce):
    return GrantRecord(LIVE, nonce, 3, b"t" * 16, (np.array([1], np.int64),),
                       ((PartClaim("kv", *[b"x" * 16] * 4),),),
                       (np.zeros((3, 1), np.uint32),))


def test_the_proxy_releases_a_grant_it_will_not_hand_over():
    from kvabi.transfer import nixl

    if not nixl.available()[0]:
        pytest.skip(nixl.available()[1])
    producer = nixl.NixlAgent("proxy-test-producer")
    table = GrantTable(4, record_bytes(1, 16, 16))
    producer.register(table.cache)
    nonce = bytes(range(16))
    table.write(2, _record(nonce), "req-2", deadline=1e9)
    params = {"kvabi_grant": {"slot": 2, "nonce": nonce.hex()},
              "kvabi_grants": producer.handshake(table.cache, include_metadata=True)}
    releaser = GrantReleaser()
    try:
        releaser.release_now(params)
        releaser.release_now(params)  # a second "done" for the same grant
        releaser.release_now({"kvabi_grant": {"slot": 2}, "kvabi_grants": 5})  # malformed
        notes = producer.wait_notification(timeout=30.0), producer.wait_notification(
            timeout=30.0)
        got = [parse_notification(m) for _, m in notes]
        assert got == [(2, nonce, 0, 1)] * 2
        assert table.release(*got[0]) == "req-2" and not table.live
        assert table.release(*got[1]) is None and table.closed(2, nonce)  # late, not forged
        assert not table.closed(2, b"f" * 16) and not table.closed(9, nonce)
        assert (releaser.sent, releaser.failed) == (2, 1)
    finally:
        releaser.close()
        producer.close()
