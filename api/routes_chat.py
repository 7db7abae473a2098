"""Chat and the diagnostic dump: 'server crashed' answers with the dump."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field

from gpuwarden.api import slacksign
from gpuwarden.api.auth import bearer_of, token_matches
from gpuwarden.api.deps import SettingsDep, SupervisorDep
from gpuwarden.api.files import read_file
from gpuwarden.api.models import DumpName, errors
from gpuwarden.daemon import logsetup
from gpuwarden.daemon.chat import (
    HELP,
    build_dump,
    chat_text,
    matches_trigger,
    save_dump,
    slack_reply,
)

log = logsetup.get_logger("gpuwarden.api")
router = APIRouter(tags=["chat"])
public = APIRouter(tags=["chat"])


class ChatReply(BaseModel):
    text: str
    trigger: str | None = None
    dump: dict[str, Any] | None = None
    saved: str | None = None
    not_saved: str | None = None  # why the dump could not be saved (it is in this reply)


class ChatMessage(BaseModel):
    text: str = Field(min_length=1)
    user: str | None = None


class SlackForm(BaseModel):
    text: str = Field(min_length=1)
    user_name: str | None = None
    channel_name: str | None = None
    token: str | None = None
    response_url: str | None = None


class DumpList(BaseModel):
    dumps: list[str]


def _read_message(raw: bytes, request: Request) -> tuple[dict[str, Any], bool]:
    """(fields, slack_form). JSON; a form (Slack/Mattermost); or JSON sent form-encoded by
    `curl -d '{...}'`, which arrives as one form key holding the whole JSON."""
    ctype = request.headers.get("content-type", "")
    text = raw.decode("utf-8", errors="replace").strip()
    if "json" in ctype or text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise HTTPException(400, f"the body is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise HTTPException(400, "the body must be a JSON object")
        return data, False
    form = {k: v[0] for k, v in parse_qs(text, keep_blank_values=True).items()}
    if not form:
        raise HTTPException(400, 'empty message: send {"text": ...} or a slash-command form')
    return form, True


@public.post(
    "/chat",
    summary="A chat message: a trigger ('server crashed') answers with the dump, else help",
    description='JSON `{"text": ..., "user": ...}` (also when `curl -d` sends it '
    "form-encoded), or a Slack/Mattermost slash-command or outgoing-webhook form. Auth: the "
    "bearer token; or a Slack request signed with `chat.signing_secret` (`X-Slack-Signature`, "
    "`X-Slack-Request-Timestamp` within 5 minutes); or the form's `token` equal to "
    "`chat.verification_token`.",
    responses={**errors(400, 401), 200: {"model": ChatReply}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": ChatMessage.model_json_schema()},
                "application/x-www-form-urlencoded": {"schema": SlackForm.model_json_schema()},
            },
        }
    },
)
async def chat(
    request: Request,
    supervisor: SupervisorDep,
    settings: SettingsDep,
    *,
    authorization: Annotated[str | None, Header()] = None,
    x_slack_signature: Annotated[str | None, Header()] = None,
    x_slack_request_timestamp: Annotated[str | None, Header()] = None,
) -> Any:
    raw = await request.body()  # the raw bytes: a Slack signature is over them, not the form
    fields, slack = _read_message(raw, request)
    token_file = request.app.state.token
    expected = token_file.current() if token_file is not None else None
    given = bearer_of(authorization)
    verification = settings.chat.verification_token
    secret = settings.chat.signing_secret
    form_token = fields.get("token")
    if x_slack_signature is not None and secret is not None:
        # A signed request stands or falls by its signature, whatever else it carries.
        why = slacksign.check(secret, x_slack_request_timestamp, x_slack_signature, raw)
        if why is not None:
            raise HTTPException(401, f"bad Slack signature: {why}")
    elif expected is not None or verification is not None or secret is not None:
        ok = (expected is not None and token_matches(expected, given)) or (
            verification is not None
            and isinstance(form_token, str)
            and token_matches(verification, form_token)
        )
        if not ok:
            raise HTTPException(
                401,
                "missing or wrong token (bearer, Slack signature, or the form's token)",
                headers={"WWW-Authenticate": "Bearer"},
            )
    text = fields.get("text")
    if not isinstance(text, str):
        raise HTTPException(400, "the message has no text")
    trigger = matches_trigger(text, settings.chat.triggers)
    if trigger is None:
        reply = HELP.format(triggers=" or ".join(f"'{t}'" for t in settings.chat.triggers))
        return JSONResponse(
            slack_reply(reply) | {"response_type": "ephemeral"}
            if slack
            else ChatReply(text=reply).model_dump()
        )
    dump = await build_dump(supervisor, why=f"chat: {text[:80]!r}")
    saved, unsaved = None, None
    try:
        saved = await asyncio.to_thread(
            save_dump, settings.state_dir, dump, settings.retention.dumps
        )
    except OSError as exc:  # a full or read-only state dir: the dump is answered all the same
        unsaved = f"{exc.strerror or exc}: {exc.filename or settings.state_dir / 'dumps'}"
        log.warning("chat.dump_not_saved", error=unsaved)
    body = chat_text(dump, saved, unsaved)
    if slack:
        return JSONResponse(slack_reply(body))
    return ChatReply(
        text=body,
        trigger=trigger,
        dump=dump.data,
        saved=saved.stem if saved else None,
        not_saved=unsaved,
    )


@router.get(
    "/dump",
    summary="The diagnostic dump now (text, or JSON with Accept: application/json)",
    responses={**errors(401), 200: {"content": {"text/plain": {}, "application/json": {}}}},
)
async def dump(request: Request, supervisor: SupervisorDep) -> Response:
    """Computed, never saved: only a chat trigger or a crash's notice saves a dump."""
    d = await build_dump(supervisor)
    if "application/json" in request.headers.get("accept", ""):
        return JSONResponse(d.data)
    return PlainTextResponse(d.text + "\n")


@router.get("/dumps", summary="Saved dumps, newest last", responses=errors(401))
async def dumps(settings: SettingsDep) -> DumpList:
    folder = settings.state_dir / "dumps"

    def names() -> list[str]:
        return sorted(p.stem for p in folder.glob("*.txt")) if folder.exists() else []

    return DumpList(dumps=await asyncio.to_thread(names))


@router.get(
    "/dumps/{name}",
    summary="One saved dump",
    response_class=PlainTextResponse,
    responses={**errors(400, 401, 404, 500), 200: {"content": {"text/plain": {}}}},
)
async def saved_dump(name: DumpName, settings: SettingsDep) -> PlainTextResponse:
    data = await read_file(settings.state_dir / "dumps" / f"{name}.txt", f"no dump {name!r}")
    return PlainTextResponse(data.decode("utf-8", errors="replace"))
