"""ShapesWorld scenes as GenEval metadata, so the `geneval` reward (and its rules) can score ShapesWorld prompts.

- one object, or one object in a region: {"tag": "single_object", include: [{class: shape, count: 1, color}]}
  (GenEval has no absolute positions: "on the left" is not checked here; `shapes_position` checks it);
- n objects: {"tag": "counting", include: [{class, count: n, color}], exclude: [{class, count: n + 1}]};
- "A relation B": {"tag": "position", include: [B, {A, position: [relation, 0]}]}, the relation words being
  GenEval's. When A and B are the same shape the classes are "<colour> <shape>", so that each clause looks at its
  own object (GenEval's rules match a clause to the most confident detections of its class).
"""

from __future__ import annotations

from typing import Any

from diffusion_rl.data.shapes import SceneSpec


def scene_metadata(spec: SceneSpec) -> dict[str, Any]:
    """GenEval metadata for a ShapesWorld scene (module docstring)."""
    groups = spec.groups
    if spec.relation is not None:
        a, b = groups
        same = a.shape == b.shape
        name_a, name_b = (f"{a.color} {a.shape}", f"{b.color} {b.shape}") if same else (a.shape, b.shape)
        include = [
            {"class": name_b, "count": 1, "color": b.color},
            {"class": name_a, "count": 1, "color": a.color, "position": [spec.relation, 0]},
        ]
        return {"tag": "position", "include": include}
    (group,) = groups
    clause = {"class": group.shape, "count": group.count, "color": group.color}
    if group.count > 1:
        return {"tag": "counting", "include": [clause], "exclude": [{"class": group.shape, "count": group.count + 1}]}
    return {"tag": "single_object", "include": [clause]}
