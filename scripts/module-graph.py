#!/usr/bin/env python3
"""The module graph of a Rust crate's `src/` and its import circles (strongly connected components
of more than one module).

    scripts/module-graph.py [SRC_DIR] [--edges] [--depth N]

SRC_DIR defaults to the repository's sidecar/src. A module is a file (`a/b.rs` or `a/b/mod.rs` is
`a::b`); `lib.rs` is the crate root and is left out (it declares and wires the modules); binaries
(`main.rs`, `bin/`) are not part of the library. An edge is any path from one module into
another: `crate::…`, `super::…` (leaving inline `mod … { }` blocks first), and paths that start at
a child module (`use cache::TtlCache;`, `limits::leasable(…)`), in `use` lines and inline,
tests included, comments and string literals not. A parent's use of its child counts too, so a
`mod.rs` that re-exports a child which uses the parent is a circle. `--depth 1` folds modules into
their top-level folder (the planes) and shows the dependencies between folders. Exits 1 when there
is a circle.
"""

import re
import sys
from pathlib import Path


def modules(src: Path) -> dict:
    out = {}
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src)
        if rel.parts[0] == "bin" or rel.as_posix() in ("main.rs", "lib.rs"):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "mod":
            parts = parts[:-1]
        out["::".join(parts)] = f
    return out


def expand_use(tree: str) -> list:
    """`a::{b, c::{d, e}}` → [`a::b`, `a::c::d`, `a::c::e`] (a tree without braces is itself)."""
    tree = tree.strip()
    m = re.match(r"^(.*?)::\{(.*)\}$", tree, flags=re.S)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    items, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [p for it in items if it.strip() for p in expand_use(prefix + "::" + it.strip())]


def code_only(text: str) -> str:
    """The text with comments removed and string and char literals emptied (so that neither a
    `//` in a URL nor a brace in a string is taken for code)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == "r" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) and re.match(r'r#*"', text[i:]):
            hashes = re.match(r"r(#*)", text[i:]).group(1)
            j = text.find('"' + hashes, i + 2 + len(hashes))
            out.append('""')
            i = n if j < 0 else j + 1 + len(hashes)
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif c == "'" and re.match(r"'(\\.[^']*|[^\\'])'", text[i:]):
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            out.append("' '")
            i += m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def inline_depths(text: str) -> list:
    """Per character, how many inline `mod name { … }` blocks enclose it."""
    depth = [0] * (len(text) + 1)
    opens = {m.end() - 1 for m in re.finditer(r"\bmod\s+\w+\s*\{", text)}
    stack, level = [], 0
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i in opens)
            level += i in opens
        elif ch == "}" and stack:
            level -= stack.pop()
        depth[i] = level
    return depth


def references(text: str, here: str) -> set:
    """Absolute paths (`crate::…` with `crate::` dropped) this module's text names."""
    text = code_only(text)
    depth = inline_depths(text)
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        paths += [(p, depth[m.start()]) for p in expand_use(m.group(1)) if re.match(r"^(crate|super|self)::", p)]
    paths += [(m.group(0), depth[m.start()]) for m in re.finditer(r"\b(?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)+", text)]
    out = set()
    for p, inline in paths:
        p = re.sub(r"\s+as\s+\w+$", "", p.strip())
        segs = p.split("::")
        base = here.split("::") if here else []
        if segs[0] == "crate":
            segs = segs[1:]
        else:
            # `self::` is this module; each `super::` leaves an inline `mod { }` first, then a file
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    if inline > 0:
                        inline -= 1
                    else:
                        base = base[:-1]
                segs = segs[1:]
            segs = base + segs
        out.add("::".join(s for s in segs if s not in ("self", "*")))
    return out


def resolve(path: str, mods: dict):
    """The longest module that is a prefix of `path`."""
    segs = path.split("::")
    for n in range(len(segs), 0, -1):
        cand = "::".join(segs[:n])
        if cand in mods:
            return cand
    return None


def child_paths(text: str, here: str, mods: dict) -> set:
    """Paths that start at a child module without `self::` (`use cache::TtlCache;`,
    `limits::leasable(…)`), made absolute."""
    text = code_only(text)
    out = set()
    for m in re.finditer(r"(?<![\w:])([a-z_][a-z0-9_]*)((?:::[A-Za-z_]\w*)+)", text):
        child = f"{here}::{m.group(1)}" if here else m.group(1)
        if child in mods:
            out.add(child + m.group(2))
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        for p in expand_use(m.group(1)):
            first = p.split("::")[0]
            child = f"{here}::{first}" if here else first
            if child in mods and not re.match(r"^(crate|super|self)::", p):
                out.add(here + "::" + p if here else p)
    return out


def graph(src: Path, depth: int = 0) -> dict:
    mods = modules(src)
    fold = (lambda m: "::".join(m.split("::")[:depth])) if depth else (lambda m: m)
    edges = {fold(m): set() for m in mods}
    for m, f in mods.items():
        text = f.read_text()
        for ref in references(text, m) | child_paths(text, m, mods):
            target = resolve(ref, mods)
            if target is None:
                continue
            a, b = fold(m), fold(target)
            if a != b:
                edges[a].add(b)
    return edges


def circles(edges: dict) -> list:
    """Tarjan's strongly connected components with more than one node."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    args = sys.argv[1:]
    show_edges = "--edges" in args
    depth = 0
    if "--depth" in args:
        depth = int(args[args.index("--depth") + 1])
        del args[args.index("--depth") : args.index("--depth") + 2]
    rest = [a for a in args if not a.startswith("--")]
    src = Path(rest[0]) if rest else Path(__file__).resolve().parent.parent / "sidecar" / "src"
    edges = graph(src, depth)
    if show_edges:
        for a in sorted(edges):
            print(f"{a} -> {', '.join(sorted(edges[a])) or '-'}")
    found = circles(edges)
    for c in found:
        print("circle: " + " <-> ".join(c))
    print(f"{len(edges)} modules, {sum(len(v) for v in edges.values())} edges, {len(found)} circle(s)")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
