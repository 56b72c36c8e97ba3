"""Keeping credentials out of everything a remote store shows: ``repr``, log records, errors."""

from __future__ import annotations

import os
import re
from typing import Any

_SECRET_OPTION = re.compile(r"key|secret|token|passw|credential|sas|auth|session|signature", re.I)
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS",
               "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING")


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``."""
    return _URL_USERINFO.sub("***@", url)


class Redactor:
    """Replaces every secret a store was given (options, URL userinfo, the environment) by ``***``.

    Secrets are the string values (4+ characters) of options whose name looks like a credential, at
    any nesting depth, the userinfo of the URL, and the cloud SDKs' credential variables.
    """

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        found: set[str] = set()

        def walk(k: str, v: Any) -> None:
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    walk(str(k2), v2)
            elif isinstance(v, str) and len(v) >= 4 and _SECRET_OPTION.search(k):
                found.add(v)

        for k, v in options.items():
            walk(k, v)
        for k in _SECRET_ENV:
            v = os.environ.get(k)
            if v and len(v) >= 4:
                found.add(v)
        m = re.search(r"://([^/@\s]+)@", url)
        if m:  # user:password@host: the password and the pair count as secrets
            found |= {m.group(1), m.group(1).partition(":")[2]}
        found.discard("")
        self.secrets = sorted(found, key=len, reverse=True)  # longest first: a secret inside another

    def __call__(self, text: str) -> str:
        text = redact_url(text)
        for s in self.secrets:
            text = text.replace(s, "***")
        return text


__all__ = ["Redactor", "redact_url"]
