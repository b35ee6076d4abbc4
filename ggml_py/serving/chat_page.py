"""The chat page served at `GET /` (chat_page.html, shipped in the package): one static file, no build step, nothing
loaded from elsewhere. It calls this server's own API from the same origin, so the access policy (access.py) needs
nothing of its own for it: `/` is outside ApiGuard's routes (the page is served without a key; its API calls carry the
key typed into it), and HostOriginGuard still refuses foreign Hosts and cross-origin requests.

The page is sent with a Content-Security-Policy that allows its one inline <style> and <script> by their SHA-256
hashes, fetches to its own origin only, and no framing: even text that slipped into the DOM as markup could run no
script, and another site cannot frame the page to make a user click in it."""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from ggml_py.errors import GgmlPyError

PAGE_FILE = "chat_page.html"


def _hashes(html: str, tag: str) -> list[str]:
    """CSP source expressions for the contents of each inline <tag> element (exact text between the tags)."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", re.sub(r"<!--.*?-->", "", html, flags=re.S), flags=re.S)
    return [f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies]


class ChatPage:
    """The page's bytes and response headers, read once (a wheel without the file fails the server's start, not the
    first visit)."""

    def __init__(self) -> None:
        try:
            html = resources.files("ggml_py.serving").joinpath(PAGE_FILE).read_text(encoding="utf-8")
        except (FileNotFoundError, OSError) as e:
            raise GgmlPyError(f"the chat page {PAGE_FILE} is missing from the installed ggml_py ({e}); "
                              "reinstall the package") from None
        scripts, styles = _hashes(html, "script"), _hashes(html, "style")
        if len(scripts) != 1 or len(styles) != 1:  # an attributed tag (<script src=...>) would not be hashed here
            raise GgmlPyError(f"{PAGE_FILE} must hold exactly one plain <script> and one <style> element")
        csp = "; ".join([
            "default-src 'none'", f"script-src {scripts[0]}", f"style-src {styles[0]}", "connect-src 'self'",
            "img-src data:", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"])
        self.body = html.encode("utf-8")
        self.headers = {
            "Content-Security-Policy": csp,
            "X-Frame-Options": "DENY",  # frame-ancestors' older form
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",  # a newer server's page, not a cached one
        }

    async def respond(self, request: Request) -> Response:
        return Response(self.body, media_type="text/html; charset=utf-8", headers=self.headers)
