"""An example MCP server (official Python SDK, streamable HTTP) whose tools
have side effects, for effectgate's tests and demos.

Tools:
- send_email(to, subject, body, delay_s=0): appends the e-mail to the outbox
  file (one JSON line each) and returns its message id. `delay_s` waits
  *after* the e-mail was written, to play a reply lost after the effect.
- refund(charge_id, amount): appends a refund to the outbox file.
- search_docs(q): read-only.
- get_email_status(to, subject): read-only; whether such an e-mail was sent
  (the read-back of send_email).
- cancel_email(message_id): cancels a sent (scheduled) e-mail: appends a
  cancellation to the outbox file, once per message; the compensating
  tool of send_email. Cancelling one already cancelled says so without a
  second record; an unknown message id is a tool error.
- get_cancellation(message_id): read-only; whether that e-mail was
  cancelled (the read-back of cancel_email).
- post_note(text): logs progress before its result (SSE notifications first).
- export_report(rows): a large result.
- always_fails(reason): the tool reports an error (isError: true).

Run: python server.py --port 9300 --outbox /tmp/outbox.jsonl
"""

import argparse
import json
import os
import time

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, default=9300)
parser.add_argument("--outbox", default="outbox.jsonl")
args = parser.parse_args()

server = MCPServer("effectgate-demo-tools")


def _append(record: dict) -> int:
    with open(args.outbox, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    with open(args.outbox, encoding="utf-8") as f:
        return sum(1 for _ in f)


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=True))
def send_email(to: str, subject: str, body: str, delay_s: float = 0, tenant: str = "") -> dict:
    """Send an e-mail (`tenant`: the sender's account, stamped by the gateway)."""
    n = _append({"kind": "email", "to": to, "subject": subject, "body": body, "tenant": tenant})
    if delay_s:
        time.sleep(delay_s)
    return {"message_id": f"msg-{n}", "status": "sent"}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=False, openWorldHint=True))
def refund(charge_id: str, amount: int) -> dict:
    """Refund part of a charge."""
    n = _append({"kind": "refund", "charge_id": charge_id, "amount": amount})
    return {"refund_id": f"re-{n}", "amount": amount}


@server.tool(annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False))
def search_docs(q: str) -> dict:
    """Search the documentation (read-only)."""
    return {"hits": [f"doc about {q}"]}


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def get_email_status(to: str, subject: str, tenant: str = "") -> dict:
    """Whether account `tenant` sent an e-mail to `to` with `subject` (read-only)."""
    if not os.path.exists(args.outbox):
        return {"found": False}
    with open(args.outbox, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            rec = json.loads(line)
            if (rec.get("kind") == "email" and rec.get("to") == to and rec.get("subject") == subject
                    and rec.get("tenant", "") == tenant):
                return {"found": True, "message_id": f"msg-{n}", "tenant": tenant}
    return {"found": False}


def _records() -> list:
    if not os.path.exists(args.outbox):
        return []
    with open(args.outbox, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True, openWorldHint=True))
def cancel_email(message_id: str) -> dict:
    """Cancel a sent e-mail before it is delivered (the compensation of send_email)."""
    records = _records()
    try:
        n = int(message_id.removeprefix("msg-"))
    except ValueError:
        n = 0
    if not (1 <= n <= len(records)) or records[n - 1].get("kind") != "email":
        raise ValueError(f"no e-mail {message_id}")
    for rec in records:
        if rec.get("kind") == "cancel" and rec.get("message_id") == message_id:
            return {"message_id": message_id, "status": "cancelled", "already": True}
    _append({"kind": "cancel", "message_id": message_id})
    return {"message_id": message_id, "status": "cancelled"}


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def get_cancellation(message_id: str) -> dict:
    """Whether e-mail `message_id` was cancelled (read-only)."""
    for rec in _records():
        if rec.get("kind") == "cancel" and rec.get("message_id") == message_id:
            return {"cancelled": True, "message_id": message_id}
    return {"cancelled": False}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
async def post_note(text: str, ctx: Context) -> dict:
    """Post a note, logging progress before the result (SSE notifications first)."""
    n = _append({"kind": "note", "text": text})
    await ctx.info(f"posting note {n}")
    return {"note_id": f"note-{n}"}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
def export_report(rows: int) -> str:
    """Write a report and return it whole (a large result)."""
    _append({"kind": "report", "rows": rows})
    return "row\n" * rows


@server.tool(annotations=ToolAnnotations(readOnlyHint=False))
def always_fails(reason: str) -> str:
    """A tool that reports an error."""
    raise ValueError(f"refused: {reason}")


uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=args.port, log_level="warning")
