#!/usr/bin/env python3
"""Checks every #include in src/<folder> and include/kiln/<folder> against the module table
of docs/ARCHITECTURE.md ("may include"): prints each include that crosses into a folder its
row does not list, and exits 1 if there is one.

  scripts/check_layering.py [REPO]
"""
import os
import re
import sys

repo = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
table = {}
for line in open(os.path.join(repo, "docs", "ARCHITECTURE.md"), encoding="utf-8"):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 3 and cells[0].startswith("`"):
        folder = cells[0].strip("`")
        table[folder] = {f.strip() for f in cells[2].split(",") if f.strip()}
if not table:
    sys.exit("docs/ARCHITECTURE.md has no module table")

include = re.compile(r'\s*#\s*include\s*"(?:kiln/)?([a-z_]+)/')
bad = []
folders = set(table)
for top in ("src", os.path.join("include", "kiln")):
    root = os.path.join(repo, top)
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if not os.path.isdir(path):
            continue
        if entry not in table:
            bad.append(f"{top}/{entry}: a folder the module table does not list")
            continue
        for dirpath, _, files in os.walk(path):
            for name in sorted(files):
                file = os.path.join(dirpath, name)
                with open(file, encoding="utf-8", errors="replace") as f:
                    for number, text in enumerate(f, 1):
                        m = include.match(text)
                        if m and m.group(1) in folders and m.group(1) != entry \
                                and m.group(1) not in table[entry]:
                            rel = os.path.relpath(file, repo)
                            bad.append(f"{rel}:{number}: {entry} includes {m.group(1)}, "
                                       f"which its row of docs/ARCHITECTURE.md does not allow")
for b in bad:
    print(b)
if bad:
    print(f"{len(bad)} include(s) break the layering: move the code, or change the table "
          "(and say why in the commit)")
    sys.exit(1)
print(f"layering: every include of {len(table)} folders follows docs/ARCHITECTURE.md")
