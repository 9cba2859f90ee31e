"""A minimal OpenAI-compatible chat-completions server on 127.0.0.1 that plays a scripted, tool-using
"model", for evaluating a verifiers environment with verifiers' own client and CLI.

Its policy, per request: with no tool result yet in the conversation it calls ``code_interpreter`` with
``x = 17 * 12``; after one it calls it with ``print(x)`` (which prints 204 only if the sandbox kept the
variable); after two it answers ``\\boxed{<what the last call printed>}``. It logs every request.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CALLS = ("x = 17 * 12", "print(x)")


class ScriptedOpenAIServer:
    """``with ScriptedOpenAIServer() as server: server.base_url`` (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # /v1/models
                self._send({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                owner.requests.append(body)
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self.send_error(404, f"only /v1/chat/completions is served, not {self.path}")
                    return
                self._send(owner.reply(body))

            def _send(self, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        tool_results = [m for m in body.get("messages", []) if m.get("role") == "tool"]
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if len(tool_results) < len(CALLS):
            code = CALLS[len(tool_results)]
            call_id = f"call_{len(tool_results)}"
            function = {"name": "code_interpreter", "arguments": json.dumps({"code": code})}
            message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
            finish = "tool_calls"
        else:
            content = tool_results[-1].get("content")
            if isinstance(content, list):  # content parts
                content = "".join(part.get("text", "") for part in content)
            message["content"] = f"The product is \\boxed{{{str(content).strip()}}}."
            finish = "stop"
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "scripted"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    def __enter__(self) -> ScriptedOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
