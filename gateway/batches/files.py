"""OpenAI's Files API, for batches: upload an input file (its format checked), read, list, delete.

An upload with `purpose: batch` has its format checked before it is stored (parse.py: each line
JSON with a custom_id, method, url and a body naming a model); a file with a malformed line is
refused with a 400 that names the bad lines. What each body asks for is checked when its item runs.
Files live in Redis (`lmq:file:<id>`, its bytes in `lmq:file:<id>:data`) for 30 days; a batch's
output and error files are files too (`purpose: batch_output`). A file belongs to the key that
uploaded it (its batch's, for an output file): another key gets 404 and lists only its own.
"""

from __future__ import annotations

from typing import Any

from aiohttp import BodyPartReader, web

from ..errors import ApiError
from . import parse
from .service import batches_of, describe, gateway_batches, owner, page_limit
from .store import RETENTION_S, FileRecord

MAX_FIELD_BYTES = 4096  # a form field other than the file


def file_object(record: FileRecord) -> dict[str, Any]:
    created = int(record.fields.get("created_at") or 0)
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": created,
        "filename": record.fields.get("filename", ""),
        "purpose": record.fields.get("purpose", "batch"),
        "status": "processed",
        "expires_at": created + RETENTION_S,
        "status_details": None,
    }


async def upload(request: web.Request) -> web.Response:
    gateway, batches = gateway_batches(request)
    limit = gateway.config.batch_max_bytes
    if not request.content_type.startswith("multipart/"):
        raise ApiError(415, "a file is uploaded as multipart/form-data with the fields `file` and `purpose`")
    reader = await request.multipart()
    purpose, filename, data = None, "", None
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "file":
            filename = part.filename or "upload.jsonl"
            data = await _read_part(part, limit, f"the file is larger than the {limit} bytes a batch input may have")
        elif part.name == "purpose":
            purpose = (await _read_part(part, MAX_FIELD_BYTES, "purpose: too long")).decode(errors="replace")
        else:
            await part.release()  # expires_after and fields a later SDK may send: not needed
    if data is None:
        raise ApiError(400, "file: is required", param="file")
    if purpose != "batch":
        raise ApiError(400, "purpose: lmq stores files for batches only: send purpose=batch", param="purpose")
    parsed = await parse.openai_file(gateway, data)
    if parsed.errors:
        raise ApiError(
            400,
            f"the file is not a valid batch input: {describe(parsed.errors, more=parsed.more_errors)}",
            param="file",
            code="invalid_file",
        )
    record = await batches.store.create_file(
        "file-", owner(request), {"filename": filename, "purpose": "batch", "lines": len(parsed.items)}, data
    )
    return web.json_response(file_object(record))


async def _read_part(part: BodyPartReader, limit: int, too_large: str) -> bytearray:
    data = bytearray()
    while chunk := await part.read_chunk(1 << 16):
        data += chunk
        if len(data) > limit:
            raise ApiError(413, too_large)
    return data


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(file_object(await _file(request)))


async def list_files(request: web.Request) -> web.Response:
    store = batches_of(request).store
    records, has_more = await store.files(
        owner(request), request.query.get("after"), page_limit(request, 10_000, 10_000)
    )
    data = [
        file_object(record)
        for record in records
        if request.query.get("purpose") in (None, record.fields.get("purpose"))
    ]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


async def content(request: web.Request) -> web.StreamResponse:
    record = await _file(request)
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    async for chunk in batches_of(request).store.file_chunks(record.id):
        await response.write(chunk)
    await response.write_eof()
    return response


async def delete(request: web.Request) -> web.Response:
    record = await _file(request)
    await batches_of(request).store.delete_file(record)
    return web.json_response({"id": record.id, "object": "file", "deleted": True})


async def _file(request: web.Request) -> FileRecord:
    file_id = request.match_info["file_id"]
    record = await batches_of(request).store.file(file_id, owner(request))
    if record is None:  # also a malformed id, and another key's file: the same 404
        raise ApiError(404, f"No such File object: {file_id}", param="id", code="not_found")
    return record
