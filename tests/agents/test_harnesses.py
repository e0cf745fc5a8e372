"""The task harnesses: LakeQA's lake tools and expert plans, its file adapter, exact match;
speaker attribution from its evidence; CTF exploits checked in the sandbox; multiple choice."""

import json

import numpy as np
import pytest

from jaxlm.agents import run_episodes
from jaxlm.agents.crypto import CTFTask, check_exploit, generate_challenges, multiple_choice_episode, \
    parse_choice, score_flag
from jaxlm.agents.lakeqa import Lake, LakeQATask, exact_match, expert_trajectory, generate_lake, lake_tools
from jaxlm.agents.speaker import SpeakerFiles, SpeakerTask, attribute_from_evidence
from jaxlm.agents.tools import Toolbox
from jaxlm.data.chat import render_tool_call


class Replay:
    """Replays each episode's assistant turns from a reference trajectory."""

    def __init__(self, trajectories):
        self.replies = []
        for messages in trajectories:
            turns = []
            for m in messages:
                if m["role"] == "assistant":
                    turns.append("".join(render_tool_call(c) for c in m.get("tool_calls") or ()) or m["content"])
            self.replies.append(turns)

    def count_tokens(self, episode, conversation, tools):
        return sum(len(m["content"]) for m in conversation)

    def act(self, episodes, conversations, tools, max_new_tokens):
        return [self.replies[i].pop(0) for i in episodes]


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_expert_plans_solve_lakeqa_through_the_loop(hops):
    task = LakeQATask(seed=3, hops=hops)
    refs = [expert_trajectory(task, i)["messages"] for i in range(12)]
    got = run_episodes(Replay(refs), [task.episode(i) for i in range(12)])
    assert [t.reward for t in got] == [1.0] * 12
    assert all(t.tool_calls == hops and not t.errors for t in got)
    assert [t.messages for t in got] == refs  # the loop records what the expert data holds


def test_lakes_differ_per_episode_and_facts_are_consistent():
    lake, facts = generate_lake(5)
    assert set(lake.files) >= {"people.csv", "companies.jsonl"}
    for line in lake.files["companies.jsonl"].splitlines():
        row = json.loads(line)
        assert facts["city"][row["company"]] == row["city"]
        assert f"country of {facts['country'][row['city']]}" in lake.files[f"cities/{row['city'].lower()}.txt"]
    answers = {LakeQATask(hops=2).instance(i)["answer"] for i in range(30)}
    assert len(answers) > 3  # not one memorisable answer


def test_search_is_whole_word_and_read_is_bounded():
    lake = Lake({"a.csv": "name\nBo,Acme\nBob,Iris\n", "b.txt": "acme is big\n"})
    box = Toolbox(lake_tools(lake))
    assert box.call("search", {"query": "Bo"}).content == "a.csv:2: Bo,Acme"
    assert box.call("search", {"query": "ACME"}).content == "a.csv:2: Bo,Acme\nb.txt:1: acme is big"
    assert box.call("search", {"query": "acme", "limit": 1}).content == "a.csv:2: Bo,Acme"
    assert box.call("search", {"query": "zzz"}).content == "no match"
    assert "at least one word" in box.call("search", {"query": "  ,"}).error
    assert box.call("read", {"path": "a.csv", "start": 2, "lines": 9}).content == "2: Bo,Acme\n3: Bob,Iris"
    assert "no file '../etc/passwd'" in box.call("read", {"path": "../etc/passwd"}).error
    assert box.call("list_files", {}).content == "a.csv\nb.txt"
    # words of any script, case-folded: "Zoë" is not the word "zo", and "東京" is a word
    box = Toolbox(lake_tools(Lake({"p.csv": "Zo,Lima\nZoë,Oslo\nJOSÉ,Rome\n", "c.txt": "東京 is in Japan\n"})))
    assert box.call("search", {"query": "zoë"}).content == "p.csv:2: Zoë,Oslo"
    assert box.call("search", {"query": "José"}).content == "p.csv:3: JOSÉ,Rome"
    assert box.call("search", {"query": "東京"}).content == "c.txt:1: 東京 is in Japan"
    # a file written with decomposed accents (NFD, as macOS names and some exports have them):
    # "Zoë" finds it and "Zoe" does not (the combining mark split the word)
    nfd = "Zoe\u0308,Oslo"
    box = Toolbox(lake_tools(Lake({"p.csv": "Zoe,Lima\n" + nfd + "\n"})))
    assert box.call("search", {"query": "Zoë"}).content == "p.csv:2: " + nfd
    assert box.call("search", {"query": "Zoe"}).content == "p.csv:1: Zoe,Lima"


def test_exact_match_normalisation():
    assert exact_match("The  Oslo.", "oslo") == 1.0
    assert exact_match("an apple", ["pear", "Apple!"]) == 1.0
    assert exact_match("Oslo city", "Oslo") == 0.0
    assert exact_match("", "Oslo") == 0.0
    # Unicode forms: a decomposed "Zoë" copied from a tool's output (search reads NFC) scored 0
    import unicodedata

    assert exact_match(unicodedata.normalize("NFD", "Zoë Corp"), "Zoë Corp") == 1.0
    assert exact_match("Zoe Corp", "Zoë Corp") == 0.0


def test_lakeqa_from_benchmark_files(tmp_path):
    lake, facts = generate_lake(1)
    lake.write(tmp_path / "lake" / "q0")
    person = facts["people"][0]
    rows = [{"question": f"Which company does {person} work for?", "answer": [facts["company"][person]], "lake": "q0"}]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    task = LakeQATask.from_files(tmp_path / "q.jsonl", tmp_path / "lake")
    assert len(task) == 1
    ep = task.episode(0)
    assert ep.toolbox.call("search", {"query": person}).content.startswith("people.csv:")
    assert ep.score(facts["company"][person]) == 1.0
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: a row needs .*answer"):
        LakeQATask.from_files(tmp_path / "bad.jsonl", tmp_path / "lake")
    for answer in ([1815, "1815 AD"], []):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x", "answer": answer}) + "\n")
        with pytest.raises(ValueError, match="bad.jsonl:1: 'answer' must be a string or a non-empty list of strings"):
            LakeQATask.from_files(tmp_path / "bad.jsonl", tmp_path / "lake")
    # a bad lake name is found when the file is read (it failed when the episode was made)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x", "answer": "y", "lake": 3}) + "\n")
    with pytest.raises(ValueError, match="row 1: 'lake' must be a directory name"):
        LakeQATask.from_files(tmp_path / "bad.jsonl", tmp_path / "lake")
    with pytest.raises(ValueError, match="does not exist"):
        Lake.from_dir(tmp_path / "nowhere")
    from jaxlm.agents.tasks import AgentTaskConfig
    with pytest.raises(ValueError, match="AgentTaskConfig.seed=-1 must be an int >= 0"):
        AgentTaskConfig(seed=-1)


def test_speaker_evidence_determines_the_speaker():
    task = SpeakerTask(seed=0, n_characters=4, n_utterances=5, off_screen=0.5, pitch_noise_hz=3.0)
    right, off = 0, 0
    for i in range(200):
        scene = task.scene(i)
        t = scene["target"]
        right += attribute_from_evidence(scene, t["id"]) == t["speaker"]
        off += t["mouth"] is None
        box = Toolbox(task.tools(scene))
        faces = box.call("faces", {"utterance": t["id"]}).content
        assert ("mouth moving: none" in faces) == (t["mouth"] is None)
        assert "no utterance 'u99'" in box.call("voice", {"utterance": "u99"}).error
    assert right == 200 and 50 < off < 150


@pytest.mark.parametrize("kw", [dict(seed=0), dict(seed=1), dict(seed=2, n_characters=8)])
def test_speaker_evidence_settles_every_default_scene(kw):
    """At the default noise (6 Hz on voices 15 Hz apart) a voice-over's pitch could come out
    nearer another off-screen character, and the evidence contradicted the gold (5 of 3000
    scenes; 55 with 8 characters): such a measurement is taken again."""
    task = SpeakerTask(**kw)
    scenes = [task.scene(i) for i in range(3000)]
    wrong = [i for i, s in enumerate(scenes) if attribute_from_evidence(s, s["target"]["id"]) != s["target"]["speaker"]]
    assert wrong == []


def test_bad_speaker_settings_are_named():
    """They passed construction and failed mid-collection with numpy's or range()'s error."""
    for kw, match in ((dict(pitch_noise_hz=-1.0), "pitch_noise_hz=-1.0"), (dict(pitch_noise_hz=float("nan")),
                      "pitch_noise_hz=nan"), (dict(n_utterances=2.5), "n_utterances=2.5"),
                      (dict(n_characters=True), "n_characters=True")):
        with pytest.raises(ValueError, match=f"SpeakerTask.{match}"):
            SpeakerTask(**kw)


def test_speaker_visual_evidence_alone_misses_voice_overs():
    task = SpeakerTask(seed=1, off_screen=0.5)
    scenes = [task.scene(i) for i in range(200)]
    visual_only = np.mean([s["target"]["mouth"] == s["target"]["speaker"] for s in scenes])
    assert 0.3 < visual_only < 0.7  # the audio evidence is needed for the rest


def test_speaker_files_adapter(tmp_path):
    row = {"question": "Who says u1?", "answer": "Ana", "evidence": {"voice": "180 Hz", "faces": "Ana speaks"}}
    (tmp_path / "s.jsonl").write_text(json.dumps(row) + "\n")
    ep = SpeakerFiles(tmp_path / "s.jsonl").episode(0)
    assert ep.toolbox.names() == ["faces", "voice"] and ep.toolbox.call("voice", {}).content == "180 Hz"
    assert ep.score("ana") == 1.0
    # the prompt names the episode's own tools (the generated task's names transcript(), cast(), ...)
    system = ep.messages[0]["content"]
    assert "voice(): The voice evidence" in system and "faces(): The faces evidence" in system
    assert "transcript" not in system and "utterance)" not in system
    assert SpeakerFiles(tmp_path / "s.jsonl", system="Custom.").episode(0).messages[0]["content"] == "Custom."


SOLVERS = {
    "xor": """
data = bytes.fromhex(open("cipher.hex").read())
for k in range(256):
    s = bytes(b ^ k for b in data)
    if s.startswith(b"flag{") and s.endswith(b"}"):
        print(s.decode())
""",
    "caesar": """
c = open("cipher.txt").read()
for k in range(26):
    s = "".join(chr((ord(x) - 97 - k) % 26 + 97) if x.islower() else x for x in c)
    if s.startswith("flag{"):
        print(s)
""",
    "rsa": """
n, e = map(int, open("public.txt").read().split())
p = next(d for d in range(3, n, 2) if n % d == 0)
q = n // p
d = pow(e, -1, (p - 1) * (q - 1))
print(bytes(pow(int(c), d, n) for c in open("cipher.txt").read().split()).decode())
""",
}
WRONG = {
    "guess": 'print("flag{0123456789}")',
    # every key's plaintext printed as a flag: the right one is among them, which is not a solve
    "shotgun": """
import os
if os.path.exists("cipher.hex"):
    data = bytes.fromhex(open("cipher.hex").read())
    for k in range(256):
        print("flag{" + bytes(b ^ k for b in data[5:-1]).hex() + "}")
        print(bytes(b ^ k for b in data).decode("latin-1"))
else:
    print("flag{aaaa} flag{bbbb}")
""",
    "crash": "raise SystemExit(open('flag.txt').read())",
}


@pytest.mark.parametrize("seed", [0, 7])
def test_ctf_scores_known_correct_and_known_wrong_exploits(seed):
    for ch in generate_challenges(seed):
        assert ch.flag not in json.dumps(ch.files)  # never in plain text
        right = check_exploit(ch, SOLVERS[ch.name])
        assert right.solved and right.flags == (ch.flag,), (ch.name, right.run)
        for why, program in WRONG.items():
            wrong = check_exploit(ch, program)
            assert not wrong.solved, (ch.name, why, wrong.flags)


def test_ctf_agent_task_runs_code_in_the_sandbox_and_scores_the_flag():
    task = CTFTask(seed=2)
    ep = task.episode(0)
    ch = task.challenge(0)
    assert ch.name == "xor"
    out = ep.toolbox.call("run_python", {"code": SOLVERS["xor"]})
    assert out.ok and ch.flag in out.content and out.content.startswith("[ok]")
    assert ep.score(f"The flag is {ch.flag}") == 1.0
    assert ep.score(f"{ch.flag} or flag{{other}}") == 0.0
    assert score_flag("no flag", ch) == 0.0


def test_multiple_choice_parsing():
    assert parse_choice("Answer: C", 4) == 2
    assert parse_choice("the answer is (b)", 4) == 1
    assert parse_choice("D", 4) == 3
    assert parse_choice("(E)", 4) is None  # past the options
    assert parse_choice("I think so", 4) is None
    assert parse_choice("The answer is a prime number, so (C).", 4) == 2  # the article is not option A
    assert parse_choice("The answer is a: (B)", 4) == 1
    assert parse_choice("answer: b.", 4) == 1 and parse_choice("ANSWER IS D", 4) == 3
    # a reply that is one letter, in either case
    assert [parse_choice(t, 4) for t in ("b", "b)", "(b)", " c. ", "e")] == [1, 1, 1, 2, None]
    # a reply opening with its option, and the answer in markdown or after a full-width colon
    replies = ("C) 7", "C) because 7 is prime", "**Answer:** B", "Answer: **B**", "Answer - C", "Answer：C",
               "The answer is **b**.")
    assert [parse_choice(t, 4) for t in replies] == [2, 2, 1, 1, 2, 2, 1]
    ep = multiple_choice_episode("Which is prime?", ["4", "6", "7"], 2)
    assert "(C) 7" in ep.messages[1]["content"] and ep.score("Answer: C") == 1.0 and ep.score("A") == 0.0
    with pytest.raises(ValueError, match="answer=3"):
        multiple_choice_episode("q", ["a", "b"], 3)
