"""Versioned run artifacts: `artifacts/<job>/<n>/` with a `latest` pointer beside them.

Each `prism run` publishes one version: the config, `metrics.json`, `report.md`, plots, and a
`version.json` that names the content hashes of its inputs (config, program source, bare graph,
calibrated timeline) and the stage outputs it used. Numbers only grow: a version is built in a
private directory and renamed into place under the next free number (rename fails if another
publisher took it, and the next number is tried), then `latest` is repointed atomically. Nothing
half-written is ever visible under a number.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"
RECORD = "version.json"


class VersionError(RuntimeError):
    pass


@dataclass
class Version:
    number: int
    path: Path
    record: dict

    @property
    def metrics(self) -> dict:
        return json.loads((self.path / "metrics.json").read_text())


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hash_tree(path: Path) -> str:
    """Content hash of a file, or of a directory's files (relative names and bytes, in order)."""
    path = Path(path)
    if path.is_file():
        return hash_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode())
        h.update(hash_file(p).encode())
    return h.hexdigest()


def hash_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def numbers(job_dir: Path) -> list[int]:
    d = Path(job_dir)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / RECORD).is_file())


def load(job_dir: Path, number: int) -> Version:
    path = Path(job_dir) / str(number)
    record = path / RECORD
    if not record.is_file():
        raise VersionError(f"no version {number} under {job_dir}")
    return Version(number, path, json.loads(record.read_text()))


def latest(job_dir: Path) -> Version | None:
    """The version `latest` points to (the highest number if the pointer is missing), or None."""
    pointer = Path(job_dir) / LATEST
    if pointer.is_symlink():
        return load(job_dir, int(os.readlink(pointer)))
    found = numbers(job_dir)
    return load(job_dir, found[-1]) if found else None


def history(job_dir: Path) -> list[Version]:
    return [load(job_dir, n) for n in numbers(job_dir)]


def publish(job_dir: Path, job: str, files: dict[str, Path | str | bytes], inputs: dict[str, str],
            stages: dict[str, str], summary: dict | None = None) -> Version:
    """Publish a new version of `job` under `job_dir` holding `files` (name -> a path to copy, or
    text / bytes to write).

    `inputs`: name -> content hash of what the run consumed; `stages`: stage -> the directory of
    the output it used (kept as references, not copied).
    """
    d = Path(job_dir)
    d.mkdir(parents=True, exist_ok=True)
    staging = d / f".staging-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        for name, value in files.items():
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(value, Path):
                shutil.copyfile(value, target)
            elif isinstance(value, bytes):
                target.write_bytes(value)
            else:
                target.write_text(value)
        record = {"job": job, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "inputs": dict(sorted(inputs.items())),
                  "stages": stages, "files": sorted(files), "summary": summary or {}}
        number = (numbers(d) or [0])[-1] + 1
        while True:
            record["version"] = number
            (staging / RECORD).write_text(json.dumps(record, indent=1))
            try:
                os.rename(staging, d / str(number))   # fails if the number is taken (non-empty directory)
                break
            except OSError:
                if not (d / str(number)).exists():
                    raise
                number += 1
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _point_latest(d, number)
    return load(d, number)


def _point_latest(d: Path, number: int) -> None:
    """Point `latest` at the highest published number (`number` or a later one).

    Reading the pointer and replacing it are two steps, so a publisher of a lower number can
    replace it just after one of a higher number did: every publisher looks again after its own
    replace, and the last replace made is always one that was checked against every number.
    """
    current = d / LATEST
    while True:
        highest = max(number, *numbers(d))
        if current.is_symlink() and int(os.readlink(current)) >= highest:
            return
        tmp = d / f".latest-{uuid.uuid4().hex}"
        os.symlink(str(highest), tmp)
        os.replace(tmp, current)
