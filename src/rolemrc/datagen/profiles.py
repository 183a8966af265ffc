"""Standardised role profiles: the seven components, validation, and the rendered profile text."""

from __future__ import annotations

from typing import Any

from rolemrc.core.errors import RolemrcError

# component key -> heading in the rendered profile (paper section 3, "profile standardisation").
COMPONENTS: dict[str, str] = {
    "name_and_description": "Role name and brief description",
    "abilities_and_skills": "Specific abilities and skills",
    "speech_style": "Speech style",
    "personality": "Personality characteristics",
    "background": "Past experience and background",
    "knowledge_boundaries": "Ability and knowledge boundaries",
    "speech_examples": "Speech examples",
}
MAX_COMPONENT_CHARS = 1200
PLACEHOLDERS = {"", "n/a", "na", "none", "unknown", "tbd", "todo", "null", "string", "text", "..."}


def _folded(text: str) -> str:
    return " ".join(text.lower().replace("_", " ").replace("-", " ").split()).strip(" .:;,!?\"'")


class ProfileError(RolemrcError, ValueError):
    """A generated profile is unusable; the message is the reason counted in the stats."""


def validate_profile(name: Any, components: Any) -> tuple[str, dict[str, str]]:
    """Return a clean (name, components) or raise ProfileError with a short reason."""
    if not isinstance(name, str) or not name.strip():
        raise ProfileError("missing name")
    if len(name) > 80 or "\n" in name.strip():
        raise ProfileError("name is not a short single line")
    if not isinstance(components, dict):
        raise ProfileError("components is not an object")
    missing = [key for key in COMPONENTS if key not in components]
    if missing:
        raise ProfileError(f"missing component {missing[0]}")
    clean = {}
    for key in COMPONENTS:
        value = components[key]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = "\n".join(value)
        if not isinstance(value, str) or not value.strip():
            raise ProfileError(f"empty component {key}")
        if len(value) > MAX_COMPONENT_CHARS:
            raise ProfileError(f"component {key} too long")
        clean[key] = value.strip()
    _check_content(name.strip(), clean)
    return name.strip(), clean


def _check_content(name: str, components: dict[str, str]) -> None:
    """Refuse a profile that has the right shape but says nothing: a placeholder or a heading for a component,
    or components that repeat the name or each other (what a small model does under a JSON Schema)."""
    for key, value in components.items():
        folded = _folded(value)
        if folded in PLACEHOLDERS or folded in (_folded(key), _folded(COMPONENTS[key])):
            raise ProfileError(f"placeholder component {key}")
    values = [_folded(v) for v in components.values()]
    if len(set(values)) < len(values) - 1 or sum(v == _folded(name) for v in values) > 1:
        raise ProfileError("components repeat each other")


def profile_text(name: str, components: dict[str, str]) -> str:
    """The profile as the role-play system prompt shows it."""
    lines = [f"You are {name}. Stay in character as described below."]
    lines += [f"{heading}: {components[key]}" for key, heading in COMPONENTS.items()]
    return "\n".join(lines)


def make_profile(pid: str, persona: str, name: str, components: dict[str, str]) -> dict[str, Any]:
    """A profile record (docs/ARCHITECTURE.md "Records"): validated, with its rendered text."""
    name, components = validate_profile(name, components)
    return {"id": pid, "persona": persona, "name": name, "components": components,
            "text": profile_text(name, components)}
