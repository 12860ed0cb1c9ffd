"""Clear answers from the demo's HTTP API where Gradio's own are bare.

Gradio routes a POST to /gradio_api/run/NAME, /call/NAME or /queue/join to an event handler. Before
the handler runs it answers an unknown NAME with a bare HTTP 500, and too few values with
`{"error": null}` (the reason goes only to the server's log, as a long traceback). On /run/, any
error a handler raises is HTTP 500, so a bad value or a full queue reads as a server fault.
`HttpErrors` checks the endpoint and the number of values first, and answers 404 or 422 with a
sentence that names what is wrong and what the endpoint takes; it gives /run/'s error answers the
status their title stands for (422 for a bad value, 503 and Retry-After for a full queue). Each
refusal is one line in the log.
"""

import json
import logging
import re
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

# The routes that call an event handler: (run|api|call[/v2])/NAME, or the queue's join with an fn_index.
HANDLER_ROUTE = re.compile(r"/gradio_api/(?:(?P<route>run|api|call)/(?:v2/)?(?P<name>[^/]+)|queue/join)/?$")
RETRY_AFTER_SECONDS = 10


def route(path: str) -> str | None:
    """How a call came in: "queue" (/gradio_api/queue/join: the page and gradio_client, in their
    session), "call" (raw HTTP through the queue), "run" (raw HTTP outside it), or None."""
    found = re.search(r"/gradio_api/(queue|call|run|api)/", path)
    return None if found is None else {"api": "run"}.get(found[1], found[1])


def owner(path: str, session: str | None, forwarded_for: str | None, address: str | None) -> str | None:
    """Whose call it is, for the queue's per-user bound: the browser session or gradio_client's. Gradio
    gives each raw HTTP call a session of its own, so those are the address they came from (the first
    X-Forwarded-For behind a proxy, as on Spaces): they count together."""
    if route(path) in (None, "queue"):
        return session
    return f"address {(forwarded_for or '').split(',')[0].strip() or address}"


class HttpErrors:
    """ASGI middleware in front of a Gradio app (`launch(app_kwargs={"middleware": [...]})`).

    `endpoints`: each API endpoint's name (without "/") and its parameters' names, in order.
    `api_names`: the endpoint name of each fn_index the queue's join may name (others are the page's own).
    `statuses`: the HTTP status for each title of the errors (gr.Error) handlers raise.
    """

    def __init__(self, app, *, endpoints: Mapping[str, Sequence[str]], api_names: Mapping[int, str],
                 statuses: Mapping[str, int]):
        self.app = app
        self.endpoints = endpoints
        self.api_names = api_names
        self.statuses = statuses

    async def __call__(self, scope, receive, send):
        match = HANDLER_ROUTE.search(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        problem = self._problem(match, body)
        if problem is not None:
            status, message = problem
            log.info("refused a request to %s: %s", scope["path"], message)
            return await _answer(send, status, {"error": message})
        if match["route"] in ("run", "api") and match["name"] in self.endpoints:  # not the page's /run/predict
            send = self._status_by_title(send)
        await self.app(scope, _replaying(body, receive), send)

    def _problem(self, match: re.Match, body: bytes) -> tuple[int, str] | None:
        """(HTTP status, sentence) for a call to an unknown endpoint or with the wrong number of values."""
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None  # Gradio refuses what is not JSON, with a 422 that says so
        payload = payload if isinstance(payload, dict) else {}
        name = match["name"]
        if "fn_index" in payload:  # the page's own calls (/queue/join, and /run/predict for unqueued events)
            name = None
        elif name is not None and name not in self.endpoints:
            known = ", ".join(f"/{endpoint}" for endpoint in self.endpoints)
            return 404, f"there is no API endpoint /{name}; this demo's are {known}"
        if name is None:
            name = self.api_names.get(payload.get("fn_index"))
            if name is None:
                return None
        values, parameters = payload.get("data"), self.endpoints[name]
        if isinstance(values, list) and len(values) != len(parameters):  # call/v2's named values are Gradio's
            return 422, (f"/{name} takes {len(parameters)} values, in this order: {', '.join(parameters)}; "
                         f"got {len(values)}")
        return None

    def _status_by_title(self, send):
        """`send`, but an HTTP 500 whose JSON error has a title in `statuses` goes out with its status."""
        held = None

        async def sending(message):
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] == 500:
                held = message  # decided on seeing the body: Gradio's error answers are one small JSON body
                return
            if held is not None and message["type"] == "http.response.body":
                try:
                    status = self.statuses.get(json.loads(message.get("body", b"")).get("title"), 500)
                except (ValueError, AttributeError, TypeError):
                    status = 500
                headers = held["headers"]
                if status == 503:
                    headers = [*headers, (b"retry-after", str(RETRY_AFTER_SECONDS).encode())]
                await send({**held, "status": status, "headers": headers})
                held = None
            await send(message)

        return sending


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive):
    """A `receive` that gives the already-read body once, then waits on the client as before."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _answer(send, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
