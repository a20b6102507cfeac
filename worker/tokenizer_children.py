"""The code of the child processes vocab_digest runs an adapter's tokenizer files in (`python -I -c`): a tenant's
tokenizer runs, and its files are parsed, with the interpreter lock and the memory of a process of their own."""

# A child's first lines: it limits itself (never above the limits it was given: CPU_S and MEMORY_BYTES, filled in
# as it starts) and offers itself to the OOM killer first.
_LIMITS = """
import json, resource, sys
for which, value, grace in ((resource.RLIMIT_CPU, CPU_S, 1), (resource.RLIMIT_AS, MEMORY_BYTES, 0)):
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard - grace)
    resource.setrlimit(which, (value, value + grace))  # past the CPU time: SIGXCPU (not the OOM killer's SIGKILL)
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
except OSError:
    pass
"""
# The child of vocab_digest._probe_isolated: builds the tokenizer from stdin, prints the probes' ids as JSON (exit
# 3: far more ids than bytes).
PROBE_CHILD = _LIMITS + """
from tokenizers import Tokenizer
texts = json.loads(sys.argv[1])
tokenizer = Tokenizer.from_str(sys.stdin.buffer.read().decode("utf-8"))
tokenizer.no_padding()
tokenizer.no_truncation()
ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
if sum(map(len, ids)) > {most}:
    sys.exit(3)
print(json.dumps(ids))
"""
# The child of vocab_digest._isolated: this module alone (its package's __init__, which imports the engine, is left out), runs
# the function argv names (_FILE_READERS) on the files whose names and sizes argv gives and whose bytes stdin
# holds, one after another; prints {"value": ...} or {"error": <the TokenizerFileError's message, or the folder
# and an error's type>}.
FILES_CHILD = _LIMITS + """
import types
from pathlib import Path
for name, where in (("lorafleet", []), ("lorafleet.worker", [{package!r}])):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = where
from lorafleet.worker import vocab_digest
raw, files, at = sys.stdin.buffer.read(), {{}}, 0
for name, size in json.loads(sys.argv[2]):
    files[name], at = raw[at:at + size], at + size
try:
    read = vocab_digest._FILE_READERS[sys.argv[3]]
    answer = json.dumps({{"value": read(Path(sys.argv[1]), files)}})
    if len(answer) > {most}:  # the worker parses it back, with its interpreter lock held
        raise vocab_digest.TokenizerFileError(f"{{sys.argv[1]}}: its tokenizer files declare more than {most} bytes "
                                              "of tokens")
    print(answer)
except vocab_digest.TokenizerFileError as exc:
    print(json.dumps({{"error": str(exc)}}))
except Exception as exc:  # its name only: a message may quote the files (a lone surrogate's UnicodeEncodeError)
    print(json.dumps({{"error": f"{{sys.argv[1]}}: not a readable tokenizer file ({{type(exc).__name__}})"}}))
"""
