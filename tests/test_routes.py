"""Routes as data (issue 24): the profile names its route, ``pipeline.ROUTES`` maps it to its stage tuple, and the
README's architecture section shows each route's stage graph."""

from __future__ import annotations

import typing
from pathlib import Path

from precision_pipeline.pipeline import ROUTES, route_of
from precision_pipeline.spec.profile import Profile, load_profile, profile_json_schema

ROOT = Path(__file__).resolve().parent.parent


def test_the_profile_names_exactly_the_routes_of_the_table():
    assert set(typing.get_args(Profile.model_fields["route"].annotation)) == set(ROUTES)
    assert Profile.model_fields["route"].default == "engine"
    shown = profile_json_schema()["properties"]["route"]  # pydantic writes one value as const, several as enum
    assert shown.get("enum", [shown.get("const")]) == sorted(ROUTES) and shown["default"] == "engine"
    assert route_of(load_profile("fp8-h100")) is ROUTES["engine"]


def test_every_route_runs_its_needs_first_and_starts_with_the_plan():
    for name, route in ROUTES.items():
        assert route.name == name and route.doc
        seen: list[str] = []
        for st in route.stages:
            assert set(st.needs) <= set(seen), f"{name}: {st.name} needs {st.needs}, before it only {seen}"
            seen.append(st.name)
        assert route.stages[0].provides_plan and not any(s.provides_plan for s in route.stages[1:])
        assert len(set(route.folders())) == len(route.folders())


def test_the_readme_shows_each_routes_stage_graph():
    text = (ROOT / "README.md").read_text()
    for name, route in ROUTES.items():
        assert f"Route `{name}`:" in text
        assert " ──► ".join(s.name for s in route.stages) in text
    assert "| `route` | `engine` |" in text and "**Adding a route** touches 2 existing code files" in text
