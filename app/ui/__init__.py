"""The chat page: `GET /` and its static files under `/ui/`, shipped inside the package (`app/ui/static/`).

Plain HTML, CSS and JavaScript: no build step, nothing fetched from a CDN, so the page works offline. It
talks to the OpenAI routes of the same server with relative URLs, so it works behind a proxy prefix; the
page is served with `<base href="{root_path}/">` so that `/prefix` (no trailing slash) resolves them too.

Both routes are open with auth on (`app/limits.py` OPEN_PATHS): the page holds no secret and asks for the
API key itself, keeping it in the tab's sessionStorage.
"""

from __future__ import annotations

import html
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")
UI_PREFIX = "/ui"
_BASE_MARK = "<!--BASE-->"

router = APIRouter(tags=["chat page"])


@lru_cache(maxsize=1)
def _page_template() -> str:
    return (STATIC_DIR / "index.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse)
async def chat_page(request: Request) -> HTMLResponse:
    """The chat page (HTML): streaming chat with the served models, a model picker, sampling settings, a
    system prompt and a Stop button. Open without credentials; with auth on, the page asks for the API key
    and sends it as `Authorization: Bearer` from the browser tab."""
    root = str(request.scope.get("root_path") or "").rstrip("/")
    base = f'<base href="{html.escape(root, quote=True)}/">'
    page = _page_template().replace(_BASE_MARK, base, 1)
    return HTMLResponse(page, headers={"Cache-Control": "no-cache"})


def install_ui(app: FastAPI) -> None:
    """`GET /` and the static files under `/ui/` (CSS, JavaScript)."""
    app.include_router(router)
    app.mount(UI_PREFIX, StaticFiles(directory=STATIC_DIR), name="ui")
