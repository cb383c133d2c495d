"""Prefill/decode disaggregation over the file tier: an OpenAI-compatible
proxy in front of a prefill instance and a decode instance of vLLM that
share one KvarnFileSpec root (docs/vllm-connectors.md "Prefill/decode").

    python -m kvarn_vllm.pd_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

For each POST /v1/completions or /v1/chat/completions:
1. the request goes to a prefill instance (kv_role kv_producer) with one
   token to generate (max_tokens 1, no streaming, n 1): it computes the
   prompt and stores its whole blocks' pages in the shared root (kvarn
   records: 4.5x fewer bytes than bf16 for kvarn_k4v2_g128);
2. then, unchanged but for kv_transfer_params {"kvarn_pd": {"wait_s": W}},
   to a decode instance (kv_role kv_consumer), whose answer (streamed or
   not) is the client's. Its file tier loads the prompt's whole blocks,
   waiting up to W seconds for blocks the prefill instance has not written
   yet (offload.pd_wait_s), and computes the rest: less than one block, for
   KVarN the last partial tile and its staging.
An error of the prefill instance is returned to the client as it came
(status and body); the decode instance is not asked. Several --prefill or
--decode URLs are taken in turn. GET /v1/models and /health go to the
first decode instance.

The proxy holds no KV: what moves between the instances is the files, so
the two may be on different machines where the root is on a file system
both mount."""
import argparse
import itertools
import json
import sys

PD_PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict) -> dict:
    """The request for the prefill instance: body with one token to
    generate, without streaming, one choice, no min_tokens."""
    pre = dict(body)
    for k in ("stream_options", "min_tokens", "best_of"):
        pre.pop(k, None)
    pre.update(max_tokens=1, stream=False, n=1)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


def decode_body(body: dict, wait_s: float) -> dict:
    """The request for the decode instance: body with {"kvarn_pd":
    {"wait_s": wait_s}} added to its kv_transfer_params."""
    from .offload import PD_KEY
    dec = dict(body)
    dec["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}),
                                 PD_KEY: {"wait_s": wait_s}}
    return dec


def make_app(prefill: list, decode: list, wait_s: float):
    """The aiohttp application: prefill and decode are lists of base URLs
    (http://host:port), taken round-robin."""
    import aiohttp
    from aiohttp import web

    pre_urls, dec_urls = itertools.cycle(prefill), itertools.cycle(decode)

    async def client(app):
        # a fresh connection per request (force_close): no pooled
        # connection an instance has closed meanwhile is written to
        app["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(force_close=True))
        yield
        await app["session"].close()

    async def post(session, url, body):
        """The instance's response (headers read; the caller releases it),
        asked a second time where the connection dropped before any answer
        (aiohttp.ServerDisconnectedError, ClientOSError: seen once in CI
        on a loaded machine); an HTTPBadGateway naming the instance where
        the second try fails too."""
        for attempt in (1, 2):
            try:
                return await session.post(url, json=body)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                err = e
        raise web.HTTPBadGateway(text=json.dumps({"error": {
            "message": f"kvarn pd_proxy: {url} did not answer ({type(err).__name__}: {err})"}}),
            content_type="application/json")

    async def relay(request, url, body):
        r = await post(request.app["session"], url, body)
        try:
            if not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type)
            out = web.StreamResponse(status=r.status,
                                     headers={"Content-Type": r.headers.get(
                                         "Content-Type", "text/event-stream")})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
        finally:
            r.release()

    async def pd(request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return web.json_response({"error": {"message": f"kvarn pd_proxy: the body is "
                                                           f"not JSON ({e})"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "kvarn pd_proxy: the body is "
                                                           "not a JSON object"}}, status=400)
        r = await post(request.app["session"], next(pre_urls) + request.path,
                       prefill_body(body))
        try:
            data = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=data, content_type=r.content_type)
        finally:
            r.release()
        return await relay(request, next(dec_urls) + request.path, decode_body(body, wait_s))

    async def forward_get(request):
        s = request.app["session"]
        async with s.get(decode[0] + request.path) as r:
            return web.Response(status=r.status, body=await r.read(),
                                content_type=r.content_type)

    app = web.Application(client_max_size=64 << 20)
    app.cleanup_ctx.append(client)
    for p in PD_PATHS:
        app.router.add_post(p, pd)
    app.router.add_get("/v1/models", forward_get)
    app.router.add_get("/health", forward_get)
    return app


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvarn_vllm.pd_proxy",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True,
                    help="base URL of a prefill instance (kv_role kv_producer); repeatable")
    ap.add_argument("--decode", action="append", required=True,
                    help="base URL of a decode instance (kv_role kv_consumer); repeatable")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--wait-s", type=float, default=60.0,
                    help="how long the decode instance waits for the prompt's blocks "
                         "(seconds, 0-3600; default 60)")
    a = ap.parse_args(argv)
    if not 0 <= a.wait_s <= 3600:
        ap.error(f"--wait-s {a.wait_s}: not in [0, 3600]")
    from aiohttp import web
    strip = [u.rstrip("/") for u in a.prefill], [u.rstrip("/") for u in a.decode]
    print(f"kvarn pd_proxy on http://{a.host}:{a.port}: prefill {strip[0]}, decode "
          f"{strip[1]}, wait {a.wait_s:g} s", flush=True)
    web.run_app(make_app(*strip, a.wait_s), host=a.host, port=a.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
