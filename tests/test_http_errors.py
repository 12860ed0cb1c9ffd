"""The API's HTTP answers (`sdxl.serving.http_errors`), in front of a stand-in for Gradio's routes."""

import json

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from sdxl.serving.http_errors import HttpErrors


async def gradio(request: Request) -> JSONResponse:
    """Like Gradio: echoes the values it got; a handler's error is HTTP 500 whatever it was."""
    payload = await request.json()
    if payload["data"] and payload["data"][0] == "busy":
        return JSONResponse({"error": "the queue is full", "title": "Queue full"}, status_code=500)
    if payload["data"] and payload["data"][0] == "broken":
        return JSONResponse({"error": "something broke", "title": "Error"}, status_code=500)
    return JSONResponse({"data": payload["data"]})


@pytest.fixture(scope="module")
def client() -> TestClient:
    routes = [Route(f"/gradio_api/{route}", gradio, methods=["POST"])
              for route in ("run/{name}", "call/{name}", "queue/join")]
    errors = Middleware(HttpErrors, endpoints={"generate": ["prompt", "seed"]}, api_names={3: "generate"},
                        statuses={"Queue full": 503})
    return TestClient(Starlette(routes=routes, middleware=[errors]))


def test_an_unknown_endpoint_is_404_with_the_known_ones(client):
    answer = client.post("/gradio_api/run/nope", json={"data": []})
    assert answer.status_code == 404
    assert answer.json() == {"error": "there is no API endpoint /nope; this demo's are /generate"}


@pytest.mark.parametrize("route", ["run/generate", "call/generate", "queue/join"])
def test_a_wrong_number_of_values_is_422_naming_the_parameters(client, route):
    answer = client.post(f"/gradio_api/{route}", json={"data": ["a fox"], "fn_index": 3})
    assert answer.status_code == 422
    assert answer.json() == {"error": "/generate takes 2 values, in this order: prompt, seed; got 1"}


def test_what_is_right_passes_through_with_its_body(client):
    assert client.post("/gradio_api/run/generate", json={"data": ["a fox", 1]}).json() == {"data": ["a fox", 1]}
    # The page's own events (fn_index of no endpoint) and what is not JSON are Gradio's to judge.
    assert client.post("/gradio_api/queue/join", json={"data": [1], "fn_index": 0}).json() == {"data": [1]}
    assert client.post("/gradio_api/run/predict", json={"data": [1], "fn_index": 0}).json() == {"data": [1]}
    busy = client.post("/gradio_api/run/predict", json={"data": ["busy"], "fn_index": 0})
    assert busy.status_code == 500  # the page reads its unqueued events' errors as Gradio sends them
    assert client.get("/gradio_api/run/nope").status_code == 405  # only POSTs call handlers


def test_run_errors_get_the_status_of_their_title(client):
    busy = client.post("/gradio_api/run/generate", json={"data": ["busy", 1]})
    assert busy.status_code == 503 and busy.headers["retry-after"] == "10"
    assert json.loads(busy.content)["error"] == "the queue is full"
    assert client.post("/gradio_api/run/generate", json={"data": ["broken", 1]}).status_code == 500
    # Only /run/ answers with the handler's error; through the queue it travels in the event stream.
    assert client.post("/gradio_api/call/generate", json={"data": ["busy", 1]}).status_code == 500
