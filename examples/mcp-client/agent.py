"""An agent-like MCP client (official Python SDK, streamable HTTP) that
calls tools through effectgate, passing a stable intent id per intent.

Usage: python agent.py URL GATEWAY_KEY STEPS_JSON
STEPS_JSON is a list of steps:
  {"list": true}                                  -> tools/list
  {"tool": "send_email", "args": {...}, "intent": "intent-1"}
  {"tool": "...", "args": {...}}                  -> no intent id (derived identity, if the route allows)
Prints one JSON line: the list of results, each
  {"tools": [...]} or {"is_error": bool, "structured": ..., "text": ..., "rpc_error": ...}.
Every call is a new JSON-RPC request id, as an agent that regenerates a call would send.
"""

import asyncio
import json
import sys

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


async def main(url: str, key: str, steps: list) -> list:
    out = []
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        async with streamable_http_client(url, http_client=http) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                for step in steps:
                    if step.get("list"):
                        tools = await session.list_tools()
                        out.append({"tools": sorted(t.name for t in tools.tools)})
                        continue
                    meta = {"effectgate/operation-id": step["intent"]} if step.get("intent") else None
                    try:
                        r = await session.call_tool(step["tool"], step.get("args", {}), meta=meta)
                        text = "".join(getattr(c, "text", "") for c in r.content)
                        out.append({"is_error": bool(r.is_error), "structured": r.structured_content, "text": text})
                    except MCPError as e:
                        out.append({"rpc_error": {"code": e.error.code, "message": e.error.message, "data": e.error.data}})
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))))
