"""A local stand-in for the Hugging Face Hub API, on 127.0.0.1: the endpoints huggingface_hub's `create_repo` and
`create_commit` (`upload_folder`'s too) call (huggingface_hub 2.x: /api/repos/create, /api/validate-yaml for a
README.md's metadata, /api/models/<repo>/preupload/<rev> and the NDJSON commit /api/models/<repo>/commit/<rev>), so that
`toolkit export --push-to-hub` is tested with nothing leaving the machine (HF_ENDPOINT points the client here).
It answers every file's upload mode as "regular", so the files come inline (base64) in the commit, and keeps each
repo's files in memory: what was uploaded is read back from it.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml


@dataclass
class Repo:
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: int = 0


class HubStandIn:
    """`with HubStandIn() as hub:` serves on `hub.endpoint`; `hub.repos` holds what was created and uploaded,
    `hub.unknown` any request it does not speak (a test asserts there is none)."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.unknown: list[str] = []
        self.cards: list[str] = []  # the model cards' metadata blocks huggingface_hub had validated
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: the test reads hub.repos
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["api", "repos", "create"]:
                    request = json.loads(body)
                    repo_id = f"{request.get('organization') or 'me'}/{request['name']}"
                    if repo_id in hub.repos:
                        return self._reply(409, {"error": "You already created this model repo",
                                                 "url": f"{hub.endpoint}/{repo_id}"})
                    hub.repos[repo_id] = Repo(private=request.get("visibility", "private" if request.get("private")
                                                                  else "public") == "private")
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})
                if parts == ["api", "validate-yaml"]:  # a README.md's metadata block, checked before a commit
                    card = json.loads(body)["content"]
                    hub.cards.append(card)
                    try:  # the block between the card's first two `---` lines, as the Hub reads it
                        metadata = yaml.safe_load(card.split("---\n")[1]) if card.startswith("---\n") else {}
                        if not isinstance(metadata, dict):
                            raise yaml.YAMLError("the metadata block is not a mapping")
                    except yaml.YAMLError as e:
                        return self._reply(400, {"errors": [{"message": str(e)}]})
                    return self._reply(200, {})
                if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] in ("preupload", "commit"):
                    repo_id = f"{parts[2]}/{parts[3]}"
                    if repo_id not in hub.repos:
                        return self._reply(404, {"error": f"Repository {repo_id} not found"})
                    if parts[4] == "preupload":
                        files = json.loads(body)["files"]
                        return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                            "shouldIgnore": False} for f in files]})
                    repo = hub.repos[repo_id]
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            assert item["value"]["encoding"] == "base64", item
                            repo.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                        elif item["key"] != "header":
                            hub.unknown.append(f"commit item {item['key']}")
                    repo.commits += 1
                    return self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{repo.commits:040d}",
                                             "commitOid": f"{repo.commits:040d}"})
                hub.unknown.append(f"POST {self.path}")
                return self._reply(404, {"error": "not served by the stand-in"})

            def do_GET(self) -> None:
                hub.unknown.append(f"GET {self.path}")
                self._reply(404, {"error": "not served by the stand-in"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
