"""`ggufrope chat` as a person uses it, in a real terminal: the console script runs in a
detached tmux session on the real SmolLM2-135M-Instruct, and the test types into it with
`tmux send-keys` and reads the screen with `tmux capture-pane`.

It checks what a user sees: the chat template named on start, the document prefilled with a
progress bar before the first question (stderr is a terminal), an answer that uses the
document, a turn that would overflow the context refused with a one-line message while the
chat goes on (the next short question is answered), and /exit ending the program with
status 0."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
GGUFROPE = ROOT / ".venv" / "bin" / "ggufrope"
TMUX = shutil.which("tmux") or "/usr/bin/tmux"
N_CTX = 1024
N_PREDICT = 40

#: ~12 short facts (~550 tokens with the template: more than one batch of 512, so the bar
#: shows), then the one the questions ask about
FILLER = "".join(
    f"The village of {name} lies {i + 3} miles north of the sea; its people keep {7 * i + 11} goats and "
    f"{2 * i + 5} boats, and their market opens on the {i % 7 + 1}th day of each month. "
    for i, name in enumerate(["Arlen", "Brisk", "Corvel", "Dunmoor", "Elsted", "Farrow", "Galen", "Hollin",
                              "Ivers", "Jessop", "Kellan", "Lorimer"])
)
FACT = ("The capital of Freedonia is Sylvania City. Sylvania City has a population of twelve thousand people, "
        "and a river called the Blue Snake runs through it.")


class Pane:
    """A command running in a detached tmux session on a private tmux server."""

    def __init__(self, command: str, cwd: Path) -> None:
        self.sock = f"ggufrope-test-{uuid.uuid4().hex[:8]}"
        self.name = "chat"
        subprocess.run([TMUX, "-L", self.sock, "-f", "/dev/null", "new-session", "-d", "-s", self.name,
                        "-x", "200", "-y", "50", "-c", str(cwd), command], check=True)

    def tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.sock, *args], check=True, capture_output=True, text=True).stdout

    def screen(self) -> str:
        """Everything the pane showed, history included, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", self.name)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.name, "-l", text)
        self.tmux("send-keys", "-t", self.name, "Enter")

    def wait_for(self, pred, what: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            s = self.screen()
            if pred(s):
                return s
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; the screen:\n{s}")
            time.sleep(0.2)

    def kill(self) -> None:
        subprocess.run([TMUX, "-L", self.sock, "kill-server"], capture_output=True)


def _prompts(s: str) -> int:
    return len(re.findall(r"^you> ", s, re.M))


def _answers(s: str) -> list[str]:
    return re.findall(r"^model> (.*)$", s, re.M)


@pytest.mark.skipif(not os.path.exists(TMUX), reason="tmux is not installed")
def test_chat_in_a_terminal(tmp_path, smollm2, patched_lib) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(FILLER + FACT + "\n", encoding="utf-8")
    cmd = (f"{GGUFROPE} chat {smollm2} -f {doc} -c {N_CTX} -n {N_PREDICT} -t 1; echo EXIT=$?; sleep 600")
    t0 = time.monotonic()
    pane = Pane(cmd, ROOT)
    try:
        s = pane.wait_for(lambda s: _prompts(s) >= 1 or "EXIT=" in s, "the first prompt", 90)
        assert "EXIT=" not in s, s
        assert "[ggufrope] chat template: from the GGUF (tokenizer.chat_template, ChatML markers)" in s, s
        assert re.search(r"\[ggufrope\] prefilling the document \(\d+ tokens with the template\)", s), s
        assert re.search(r"prefill: 100%\|.*\| (\d+)/\1 ", s), s  # the bar, on a terminal, finished
        assert f"[ggufrope] n_ctx {N_CTX}: as given by -c" in s, s
        assert "[ggufrope] /reset clears the conversation (the system prompt and the document stay), /exit or " \
               "Ctrl-D ends it" in s, s
        assert "Traceback" not in s

        pane.type("What is the capital of Freedonia?")
        s = pane.wait_for(lambda s: _prompts(s) >= 2, "the first answer", 60)
        a = _answers(s)
        assert len(a) == 1 and "Sylvania" in a[0], s  # an answer, from the document

        # a pasted line that overflows the context: refused, nothing evaluated, the chat goes on
        pane.type("word " * 700)
        s = pane.wait_for(lambda s: _prompts(s) >= 3, "the refusal", 30)
        m = re.search(r"^ggufrope: this turn needs (\d+) tokens \(\d+ of conversation \+ -n (\d+)\), the context "
                      r"holds (\d+): send a shorter message, /reset to drop the earlier turns \(the document "
                      r"stays\), or restart with a larger --n-ctx \(or a smaller -n\)$", s, re.M)
        assert m, s
        assert int(m.group(1)) > N_CTX and int(m.group(2)) == N_PREDICT and int(m.group(3)) == N_CTX
        assert len(_answers(s)) == 1, s  # no answer to the refused turn

        pane.type("How many people live in Sylvania City?")
        s = pane.wait_for(lambda s: _prompts(s) >= 4, "the answer after the refusal", 60)
        a = _answers(s)
        assert len(a) == 2 and a[1].strip(), s

        pane.type("/exit")
        s = pane.wait_for(lambda s: "EXIT=" in s, "the end of the program", 30)
        assert re.search(r"^EXIT=0$", s, re.M), s
        assert "Traceback" not in s and "Error" not in s, s
    finally:
        pane.kill()
    print(f"tmux chat test: {time.monotonic() - t0:.1f} s")
