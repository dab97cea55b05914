"""OpenAI's list pages (`{"object": "list", "data", "first_id", "last_id", "has_more"}`), shared by every family
that lists stored objects: stored chat completions and their messages, a stored response's input items."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel


class ListPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def list_page(page: list[dict[str, Any]], has_more: bool) -> ListPage:
    """One page of objects that carry an `id`."""
    return ListPage(data=page, first_id=page[0]["id"] if page else None,
                    last_id=page[-1]["id"] if page else None, has_more=has_more)


def page_after(items: Sequence[dict[str, Any]], order: str, after: str | None, limit: int) -> ListPage:
    """The page of `items` (oldest first as given; reversed for `order="desc"`) after the item with id `after`."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    ids = [item["id"] for item in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    return list_page(ordered[start:start + limit], start + limit < len(ordered))
