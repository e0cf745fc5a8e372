"""DramaSR-style speaker attribution: who says an utterance, decided from tools that return
text, audio and visual evidence about it.

A generated scene has a cast (each character with a typical voice pitch) and a script of
utterances, each with its speaker. Evidence tools, per utterance id (``u1``, ``u2``, ...):

- ``transcript()``: every line of the script, ``u<k>: <text>`` (no speaker names);
- ``cast()``: each character and their typical pitch;
- ``voice(utterance)``: the pitch measured on that utterance (the speaker's, with noise);
- ``faces(utterance)``: who is on screen and whose mouth moves. In a share ``off_screen`` of
  utterances the speaker is off screen (a voice-over: the mouth that moves belongs to nobody
  on screen), so the visual evidence is missing and the pitch has to decide; the pitch
  alone is ambiguous when two voices are close, which the faces settle.

The answer is a character name, scored by exact match. Real benchmark files: `SpeakerFiles`
reads a jsonl of ``{"utterance", "question", "answer", "evidence": {tool: text}}`` rows, each
tool returning the stored evidence text, so a benchmark's pre-extracted audio/visual
features plug into the same loop and scoring.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from jaxlm.agents.lakeqa import exact_match
from jaxlm.agents.loop import Episode, question_episode, read_rows
from jaxlm.agents.tools import Toolbox, tool

CHARACTERS = ("Ana", "Ben", "Cal", "Dot", "Eve", "Fox", "Gil", "Hana")
LINES = ("Where were you last night?", "I told you already.", "We should leave now.", "Not without the key.",
         "Who opened the door?", "It was locked before.", "Listen to me.", "I heard a noise.")

SYSTEM = ("Find who speaks the utterance. Tools: transcript(), cast(), voice(utterance), faces(utterance). "
          "One tool call per line as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
          "reply with the speaker's name alone when you know it.")


@dataclasses.dataclass(frozen=True)
class SpeakerTask:
    """Episode ``i``: a scene from seed ``(seed, i)`` with ``n_characters`` and
    ``n_utterances``, and a question about one utterance."""

    seed: int = 0
    n_characters: int = 3
    n_utterances: int = 4
    off_screen: float = 0.3
    pitch_noise_hz: float = 6.0
    system: str = SYSTEM

    def __post_init__(self):
        for name in ("n_characters", "n_utterances"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):  # failed mid-collection, naming nothing
                raise ValueError(f"SpeakerTask.{name}={v!r} must be an int")
        if not 2 <= self.n_characters <= len(CHARACTERS):
            raise ValueError(f"SpeakerTask.n_characters={self.n_characters} must be in [2, {len(CHARACTERS)}]")
        if self.n_utterances < 1 or not 0 <= self.off_screen <= 1:
            raise ValueError("SpeakerTask.n_utterances must be >= 1 and off_screen in [0, 1]")
        v = self.pitch_noise_hz
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ValueError(f"SpeakerTask.pitch_noise_hz={v!r} must be a finite number >= 0")

    def scene(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, index, 3])
        cast = [CHARACTERS[i] for i in rng.choice(len(CHARACTERS), self.n_characters, replace=False)]
        pitch = {c: int(p) for c, p in zip(cast, rng.choice(np.arange(90, 260, 15), self.n_characters, replace=False))}
        utterances = []
        for k in range(self.n_utterances):
            speaker = cast[int(rng.integers(len(cast)))]
            others = [c for c in cast if c != speaker]
            visible = sorted(set(rng.choice(others, int(rng.integers(1, len(others) + 1)), replace=False).tolist()))
            off = bool(rng.random() < self.off_screen)
            if not off:
                visible = sorted(set(visible) | {speaker})
            text = LINES[int(rng.integers(len(LINES)))]
            measured = int(round(pitch[speaker] + rng.normal(0, self.pitch_noise_hz)))
            # off screen, the pitch alone decides among the characters not on screen: noise that
            # brings it nearer another of them (or level with one) is measured again, so the
            # evidence always settles the answer (it contradicted the gold in ~0.2% of scenes)
            pool = [c for c in cast if c not in visible]
            while off and any(abs(pitch[c] - measured) <= abs(pitch[speaker] - measured) for c in pool if c != speaker):
                measured = int(round(pitch[speaker] + rng.normal(0, self.pitch_noise_hz)))
            utterances.append({"id": f"u{k + 1}", "text": text, "speaker": speaker, "pitch": measured,
                               "visible": visible, "mouth": None if off else speaker})
        target = utterances[int(rng.integers(len(utterances)))]
        return {"cast": cast, "pitch": pitch, "utterances": utterances, "target": target}

    def tools(self, scene: dict[str, Any]):
        by_id = {u["id"]: u for u in scene["utterances"]}

        def utterance_of(utterance: str) -> dict[str, Any]:
            if utterance not in by_id:
                raise ValueError(f"no utterance {utterance!r}; the ids are {sorted(by_id)}")
            return by_id[utterance]

        @tool
        def transcript() -> str:
            """Every line of the script as u<k>: text."""
            return "\n".join(f"{u['id']}: {u['text']}" for u in scene["utterances"])

        @tool
        def cast() -> str:
            """The characters and their typical voice pitch."""
            return "; ".join(f"{c} {scene['pitch'][c]} Hz" for c in scene["cast"])

        @tool
        def voice(utterance: str) -> str:
            """The voice pitch measured on one utterance."""
            return f"{utterance_of(utterance)['pitch']} Hz"

        @tool
        def faces(utterance: str) -> str:
            """Who is on screen during one utterance and whose mouth moves."""
            u = utterance_of(utterance)
            return f"on screen: {', '.join(u['visible'])}; mouth moving: {u['mouth'] or 'none'}"

        return [transcript, cast, voice, faces]

    def episode(self, index: int) -> Episode:
        scene = self.scene(index)
        t = scene["target"]
        question = f"Who says {t['id']} ({t['text']!r})?"
        return question_episode(self.system, question, Toolbox(self.tools(scene)),
                                lambda a, gold=t["speaker"]: exact_match(a, gold),
                                {"index": index, "answer": t["speaker"], "off_screen": t["mouth"] is None})


def attribute_from_evidence(scene: dict[str, Any], utterance: str) -> str:
    """The rule the evidence supports: the moving mouth if there is one, else the cast member
    whose typical pitch is nearest the measured pitch among those not on screen (a voice-over
    comes from off screen), falling back to the whole cast."""
    u = next(x for x in scene["utterances"] if x["id"] == utterance)
    if u["mouth"] is not None:
        return u["mouth"]
    pool = [c for c in scene["cast"] if c not in u["visible"]] or list(scene["cast"])
    return min(pool, key=lambda c: (abs(scene["pitch"][c] - u["pitch"]), c))


def files_system(toolbox: Toolbox) -> str:
    """The system prompt of a file-backed episode: the task and its own tools, one per line."""
    return ("Find who speaks the utterance. Tools:\n" + toolbox.describe() + "\nOne tool call per line as "
            "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; reply with the speaker's name alone "
            "when you know it.")


def _evidence_tool(name: str, text: str):
    def evidence() -> str:
        return text
    return tool(evidence, name=name, description=f"The {name} evidence for the utterance.")


class SpeakerFiles:
    """Speaker-attribution episodes from a benchmark's jsonl (see the module docstring)."""

    def __init__(self, path: str | Path, system: str | None = None):
        """``system``: the episodes' system prompt (None: `files_system` of each row's own
        evidence tools; the generated task's `SYSTEM` names tools these episodes lack)."""
        self.path, self.system = str(path), system
        self._rows = read_rows(path, {"question": str, "answer": (str, list), "evidence": dict})

    def __len__(self) -> int:
        return len(self._rows)

    def episode(self, index: int) -> Episode:
        row = self._rows[index]
        toolbox = Toolbox([_evidence_tool(str(name), str(text)) for name, text in row["evidence"].items()])
        system = self.system if self.system is not None else files_system(toolbox)
        return question_episode(system, row["question"], toolbox,
                                lambda a, gold=row["answer"]: exact_match(a, gold), {"index": index, "answer": row["answer"]})
