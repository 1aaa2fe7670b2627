"""Forms in, for every route that takes one (``/v1/tts``, ``/v1/audio/voices``): the
multipart frame checked whole, at most one file, read within its size limit.

Instance side: starlette only.
"""

from __future__ import annotations

from typing import Any

from cosyvoice_lb.instance.speech.validation import MIN_PROMPT_SECONDS, BadRequest, multipart_problem


async def read_form(request: Any, file_field: str, fields: int, max_bytes: int) -> tuple[dict[str, str], bytes | None]:
    """(the text fields, the file ``file_field``'s bytes or None) of a multipart or
    urlencoded form of at most ``fields`` text fields."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() == "multipart/form-data":
        problem = multipart_problem(content_type, await request.body())
        if problem:
            raise BadRequest(f"the form could not be read ({problem}): send the whole multipart/form-data body")
    try:
        form = await request.form(max_files=1, max_fields=fields + 1)
    except Exception as exc:  # malformed multipart, too many parts
        raise BadRequest(f"the form could not be read ({exc}): send multipart/form-data") from None
    upload = form.get(file_field)
    values = {k: v for k, v in form.items() if k != file_field}
    if any(not isinstance(v, str) for v in values.values()):
        raise BadRequest(f"only {file_field} may be a file; the other fields are text")
    data = None
    if upload is not None and not isinstance(upload, str):
        data = await upload.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise BadRequest(
                f"{file_field} is larger than {max_bytes // 2**20} MiB: send a smaller file "
                f"({MIN_PROMPT_SECONDS:g} s of speech is enough to clone a voice)",
                status=413,
            )
    elif isinstance(upload, str) and upload:
        raise BadRequest(f"{file_field} must be a file upload, not a text field")
    return values, data
