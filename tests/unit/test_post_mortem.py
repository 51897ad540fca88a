"""``%%launch_ddp --pdb``'s kernel side (``launch.kernel_side.post_mortem``) with debugger sockets served here."""

import socket
import threading

from gpumagic.launch.kernel_side.post_mortem import PostMortems
from gpumagic.launch.messages import DebugIO, Stdin, from_json_line, to_json_line
from gpumagic.launch.rank_side.debugging import PROMPT
from gpumagic.run_dirs.layout import RunFiles


def serve_one_prompt(path, answers: list[str]) -> threading.Thread:
    """A rank's post-mortem debugger at ``path``: one frame, one prompt; the line it is sent goes to ``answers``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(2)  # the unused one gives up

    def serve() -> None:
        with server:
            try:
                connection, _ = server.accept()
            except TimeoutError:
                return
            with connection, connection.makefile("rw", encoding="utf-8", newline="\n") as stream:
                stream.write(to_json_line(DebugIO(f"> {path.name}\n", None)))
                stream.write(to_json_line(DebugIO("(Pdb) ", PROMPT)))
                stream.flush()
                answers.append(from_json_line(stream.readline(), Stdin).line)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_only_the_first_failed_ranks_debugger_runs_and_q_ends_the_launch(tmp_path):
    """After q in rank 1's debugger its peer failed too (its all_reduce broke as rank 1 left) and served a second
    debugger, whose prompt the cell showed as well (a fresh-clone CI run, one core kept busy)."""
    files = RunFiles(tmp_path)
    files.launch.mkdir(mode=0o700)
    answers: list[str] = []
    servers = [serve_one_prompt(files.rank_debug_socket(rank), answers) for rank in (0, 1)]
    written: list[str] = []
    prompts: list[str] = []
    mortems = PostMortems(files, 2, written.append, read_line=lambda prompt: prompts.append(prompt) or "q")
    mortems.poll()
    mortems.poll()
    assert prompts == ["(Pdb) "] and answers == ["q"]
    assert sum("--pdb: its debugger is here" in text for text in written) == 1
    for server in servers:
        server.join(10)
