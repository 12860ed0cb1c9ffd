"""The demo as an MCP server (`python app.py --mcp`): an MCP client, over Gradio's streamable HTTP
transport, finds the endpoints as described tools, and gets a tool's images back."""

import asyncio
import base64
import io
import os
import urllib.request

import pytest
from PIL import Image

from sdxl.bench.soak import running_app

pytestmark = pytest.mark.server

TOOLS = {"generate", "image_to_image", "compare", "grid", "upscale"}


async def _session(url: str, calls):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async with streamablehttp_client(url + "gradio_api/mcp/") as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            return await calls(session)


def test_an_mcp_client_lists_the_tools_and_gets_generated_images_back(tmp_path):
    env = os.environ | dict(HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", GRADIO_TEMP_DIR=str(tmp_path))

    async def calls(session):
        tools = (await session.list_tools()).tools
        generated = await session.call_tool("generate", {"prompt": "a red circle on a blue background", "seed": 3,
                                                         "steps": 2})
        refused = await session.call_tool("generate", {"prompt": "a red circle", "steps": 500})
        return tools, generated, refused

    args = ["--model", "shapes", "--mcp", "--max-images-per-core", "1"]
    with running_app(args, tmp_path / "app.log", env) as (_, url):
        tools, generated, refused = asyncio.run(_session(url, calls))
        # Each image as image content, then its URL, which the client can fetch: the PNG with its settings.
        images = [Image.open(io.BytesIO(base64.b64decode(c.data))) for c in generated.content if c.type == "image"]
        texts = [c.text for c in generated.content if c.type == "text"]
        fetched = Image.open(io.BytesIO(urllib.request.urlopen(texts[0].removeprefix("Image URL: ")).read()))

    by_name = {tool.name: tool for tool in tools}
    assert set(by_name) == TOOLS, "the endpoints, and no internal event (checks, previews, token counts)"
    generate = by_name["generate"]
    assert generate.description.startswith("Draws images from a text prompt with Stable Diffusion XL")
    schema = generate.inputSchema["properties"]
    assert schema["steps"]["type"] == "number" and "denoising steps" in schema["steps"]["description"]
    assert schema["style"]["enum"][0] == "No style" and "lora" not in " ".join(schema)
    assert by_name["upscale"].inputSchema["required"] == ["picture"]

    assert not generated.isError
    assert [image.size for image in images] == [(64, 64)] * 4, "one per device"
    assert texts[-1].startswith("4 images in ")
    assert fetched.size == (64, 64) and "Seed: 3" in fetched.info["parameters"]
    assert refused.isError and [c.text for c in refused.content] == ["steps must be an integer from 1 to 100, got 500"]
