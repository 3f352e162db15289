"""The OpenAI routes of ``transformers serve`` with what P/D and its clients send beside
transformers' own fields, as vLLM's server takes them (``specs/pd.md`` section 4.7):

- ``kv_transfer_params`` (request): the producer's ask, or a producer's answer to pull from;
  (response, top level) a producer's answer for a held request;
- ``return_token_ids``: the choice's ``token_ids`` and the prompt's ``prompt_token_ids``
  (non-streaming answers);
- ``ignore_eos``: generate ``max_tokens`` tokens whatever comes.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take these fields out of the
body, hand them to the continuous-batching manager with the request
(:mod:`.context`), call transformers' own handler, and complete its JSON answer.  A
request that fails (its parameters refused, its pull failed) gets status 500 and the
reason; one transformers refuses gets transformers' status; both as OpenAI error objects.
``GET /kvabi/status`` says what the server runs: backend, layouts, block size, P/D role,
the parts it serves and the size of every per-request table.
"""
# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations
# (Request, dict), which are imported where the routes are made.
import json
import logging

from kvabi import KVABIError
from kvabi.util.coerce import as_bool

from .context import RequestAsk, asking

log = logging.getLogger("kvabi_transformers.serve")

#: routes whose body may carry kvabi's fields
ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def read_ask(body: dict, request_id: str) -> "RequestAsk":
    """Take kvabi's fields out of ``body``; KVABIError naming a field of the wrong type."""
    params = body.pop("kv_transfer_params", None)
    flags = {}
    for key in ("ignore_eos", "return_token_ids"):
        v = body.pop(key, None)
        flags[key] = False if v is None else as_bool(v, key)
    return RequestAsk(request_id, params, **flags)


def error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


def _manager(models):
    """The kvabi continuous-batching manager serving now, or None."""
    for model in models():
        integration = getattr(model, "_kvabi_integration", None)
        ref = getattr(integration, "manager", None)
        manager = ref() if ref is not None else None
        if manager is not None:
            return manager
    return None


def complete_answer(data: dict, ask: RequestAsk, kind: str, manager) -> dict:
    """transformers' JSON answer with the producer's answer and the token ids asked."""
    if manager is None:
        return data
    answer = manager.take_kv_transfer_params(ask.request_id)
    if answer is not None:
        data["kv_transfer_params"] = answer
    ids = manager.take_token_ids(ask.request_id)
    if ask.return_token_ids and ids is not None and data.get("choices"):
        prompt, generated = ids
        data["choices"][0]["token_ids"] = generated
        if kind == "chat":
            data["prompt_token_ids"] = prompt
        else:
            data["choices"][0]["prompt_token_ids"] = prompt
    return data


def install(app, handlers: dict, models, served=(None, None)) -> None:
    """Replace ``app``'s completion routes by kvabi's (``handlers``: route kind ->
    transformers' handler; ``models()``: the models loaded now; ``served``: (a name
    requests may give the model, the model the server is pinned to)) and add
    ``/kvabi/status``."""
    from fastapi import HTTPException, Request
    from fastapi.responses import JSONResponse
    from fastapi.routing import APIRoute
    from transformers.cli.serving.utils import CBWorkerDeadError

    app.router.routes[:] = [r for r in app.router.routes
                            if not (isinstance(r, APIRoute) and r.path in ROUTES)]

    def route(kind: str):
        handler = handlers[kind]

        async def endpoint(request: Request, body: dict):
            rid = request.state.request_id
            if served[0] is not None and body.get("model") == served[0]:
                body["model"] = served[1]
            try:
                ask = read_ask(body, rid)
            except KVABIError as e:
                return error(400, str(e), "invalid_request_error")
            manager = None
            try:
                with asking(ask):
                    try:
                        resp = await handler.handle_request(body, rid)
                    except HTTPException as e:
                        return error(e.status_code, str(e.detail), "invalid_request_error")
                    except CBWorkerDeadError:
                        raise
                    except RuntimeError as e:  # the request failed in the engine, alone
                        why = str(e)  # transformers' words first, then the reason
                        why = why.removeprefix(f"CB generation failed for {rid}: ")
                        return error(500, why, "server_error")
                manager = _manager(models)
                if not isinstance(resp, JSONResponse) or resp.status_code != 200:
                    return resp
                data = complete_answer(json.loads(resp.body), ask, kind, manager)
                return JSONResponse(data, status_code=200)
            finally:
                manager = manager or _manager(models)
                if manager is not None:  # nothing left behind for this request id
                    manager.take_kv_transfer_params(rid)
                    manager.take_token_ids(rid)
        return endpoint

    for path, kind in ROUTES.items():
        app.add_api_route(path, route(kind), methods=["POST"])

    @app.get("/kvabi/status")
    def status():
        return JSONResponse(server_status(models))


def server_status(models) -> dict:
    """What runs: per kvabi-served model its backend, layouts and block size; P/D: its role,
    the parts it serves and the entries of every per-request table."""
    out = []
    for model in models():
        integ = getattr(model, "_kvabi_integration", None)
        if integ is None:
            continue
        item = {"backend": integ.backend.name, "layouts": list(integ.layout_names),
                "block_size": integ.block_size, "pd": None}
        if integ.pd is not None:
            ref = integ.manager
            manager = ref() if ref is not None else None
            conn = getattr(manager, "connector", None)
            item["pd"] = {"role": integ.pd.settings.role,
                          "parts": conn.part_layouts() if conn is not None else None,
                          "tables": conn.table_sizes() if conn is not None else None,
                          "stats": dict(conn.stats) if conn is not None else None,
                          "pulls": conn.pulls() if conn is not None else None}
        out.append(item)
    return {"models": out}


__all__ = ["ROUTES", "complete_answer", "install", "read_ask", "server_status"]
