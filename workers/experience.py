"""Built-in episode hook: experience injection, template mode (the original driver's
``TemplateExpEpisodeHandler``).

    interactor run tasks.yaml --episode-hook workers.experience:template --experience-dir skills/

Each worker reads the folder on its own machine (``experience_dir`` setting, i.e.
``INTERACTOR_EXPERIENCE_DIR`` or ``--experience-dir``), laid out as the original's::

    skills/
      index.yaml
      guess_number/binary-search/SKILL.md
      ...

``index.yaml``::

    environments:
      guess_number:                      # an env type; matches env_names containing it (or contained in it)
        - name: binary-search
          trigger: the feedback says too high or too low   # optional: "Apply when: ..."
          success_rate: 0.92
          path: guess_number/binary-search/SKILL.md        # optional; this is the default

At an episode's first step the hook picks the matching skills, best ``success_rate`` first
(ties by name, descending, as the original), keeps ``experience_top_k`` (default 3) whose file
exists, and renders::

    ## Relevant Experiences

    **Experience: binary-search**
    *Apply when*: the feedback says too high or too low

    <SKILL.md>

    ---

    **Experience: ...**

This text is appended to the system message of every prompt of the episode (a system message is
inserted first when the prompt has none). The index is re-read when its file changes, so skills
can be updated while a job runs. Template mode records no feedback; ``on_episode_end`` only
drops the episode's cached text. Errors are logged; the prompt is then left as it was.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("interactor.experience")

__all__ = ["TemplateExperienceHook", "template", "inject", "HEADER"]

HEADER = "## Relevant Experiences"
_CACHE_MAX = 100_000  # episodes whose text is held at once (on_episode_end releases them)


@dataclass(frozen=True)
class Skill:
    env_type: str
    name: str
    path: str
    trigger: str
    success_rate: float


class TemplateExperienceHook:
    def __init__(self, exp_dir: str | os.PathLike, top_k: int = 3):
        self.exp_dir = Path(exp_dir)
        self.top_k = max(1, int(top_k))
        self._lock = threading.Lock()
        self._cache: dict[str, str | None] = {}
        self._index: tuple[Any, Any] | None = None  # (mtime_ns, size) key, parsed skills

    # ---- the hook ------------------------------------------------------------------------
    def handle(self, env_name: str, env_id: str, step_id: int, prompt: Any) -> Any:
        with self._lock:
            cached = env_id in self._cache
            text = self._cache.get(env_id)
        if step_id == 1 or not cached:  # a retried attempt starts at step 1 again: recompute
            text = self.render(env_name)
            with self._lock:
                if len(self._cache) >= _CACHE_MAX:
                    self._cache.clear()
                self._cache[env_id] = text
        return inject(prompt, text) if text else prompt

    def on_episode_end(self, env_name: str, env_id: str, total_reward: float, info: dict | None) -> None:
        with self._lock:
            self._cache.pop(env_id, None)

    # ---- selection and rendering ---------------------------------------------------------
    def skills(self) -> list[Skill]:
        """Every skill of the index (re-read when the file changed); [] without an index."""
        index_path = self.exp_dir / "index.yaml"
        if not index_path.exists():
            index_path = self.exp_dir / "index.yml"
        try:
            st = index_path.stat()
        except OSError:
            log.debug("experience index not found in %s", self.exp_dir)
            return []
        key = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if self._index is not None and self._index[0] == key:
                return self._index[1]
        try:
            doc = yaml.safe_load(index_path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            log.error("cannot read the experience index %s: %s", index_path, exc)
            return []
        skills = _parse_index(doc, index_path)
        with self._lock:
            self._index = (key, skills)
        return skills

    def select(self, env_name: str) -> list[Skill]:
        matching = [s for s in self.skills() if s.env_type in env_name or env_name in s.env_type]
        return sorted(matching, key=lambda s: (s.success_rate, s.name), reverse=True)

    def render(self, env_name: str) -> str | None:
        blocks = []
        for skill in self.select(env_name):
            if len(blocks) >= self.top_k:
                break
            path = self.exp_dir / skill.path
            try:
                content = path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                log.warning("experience %s/%s: cannot read %s: %s", skill.env_type, skill.name, path, exc)
                continue
            header = f"**Experience: {skill.name}**"
            if skill.trigger:
                header += f"\n*Apply when*: {skill.trigger}"
            blocks.append(f"{header}\n\n{content}")
        if not blocks:
            return None
        log.debug("injecting %d experience(s) for env_name=%s", len(blocks), env_name)
        return f"{HEADER}\n\n" + "\n\n---\n\n".join(blocks)


def _parse_index(doc: Any, where: Path) -> list[Skill]:
    envs = doc.get("environments") if isinstance(doc, dict) else None
    if not isinstance(envs, dict):
        log.error("experience index %s: expected a mapping 'environments: {env_type: [skills]}'", where)
        return []
    out = []
    for env_type, entries in envs.items():
        for entry in entries or []:
            if not isinstance(entry, dict):
                continue
            name = str(entry.get("name") or "").strip()
            if not name:
                continue
            try:
                rate = float(entry.get("success_rate") or 0.0)
            except (TypeError, ValueError):
                rate = 0.0
            path = str(entry.get("path") or f"{env_type}/{name}/SKILL.md").strip()
            out.append(Skill(str(env_type), name, path, str(entry.get("trigger") or "").strip(), rate))
    return out


def inject(prompt: Any, text: str) -> Any:
    """The prompt with ``text`` appended to its first system message (or a new one first).
    The caller's list and messages are not modified."""
    if not isinstance(prompt, list):
        return prompt
    out = list(prompt)
    for i, msg in enumerate(out):
        if isinstance(msg, dict) and msg.get("role") == "system":
            content = msg.get("content")
            if isinstance(content, list):
                new: Any = [*content, {"type": "text", "text": f"\n\n{text}"}]
            elif content:
                new = f"{content}\n\n{text}"
            else:
                new = text
            out[i] = {**msg, "content": new}
            return out
    out.insert(0, {"role": "system", "content": text})
    return out


def template() -> TemplateExperienceHook | Any:
    """The factory for ``--episode-hook workers.experience:template``: reads
    ``experience_dir`` and ``experience_top_k`` from this worker's settings."""
    from broker.settings import Settings
    from workers.hooks import NullHook

    settings = Settings.from_env()
    if not settings.experience_dir:
        log.error("workers.experience:template: no experience_dir set (INTERACTOR_EXPERIENCE_DIR or "
                  "--experience-dir); injecting nothing")
        return NullHook()
    if not os.path.isdir(settings.experience_dir):
        log.warning("workers.experience:template: %s is not a folder (yet); injecting nothing until it is",
                    settings.experience_dir)
    log.info("experience injection (template): dir=%s top_k=%d", settings.experience_dir, settings.experience_top_k)
    return TemplateExperienceHook(settings.experience_dir, top_k=settings.experience_top_k)
