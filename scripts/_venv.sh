# Sourced by scripts/serve and scripts/test: make .venv and install the project into it
# (again only when pyproject.toml changed). $1 is the extra to install ("" or "dev").
set -euo pipefail
extra="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.installed-${extra:-base}"
# "dev" holds every extra: while it is up to date, it serves the others too.
if [ -f .venv/.installed-dev ] && [ ! pyproject.toml -nt .venv/.installed-dev ]; then
  stamp=.venv/.installed-dev
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ -n "$extra" ]; then
    .venv/bin/python -m pip install -q -e ".[${extra}]"
  else
    .venv/bin/python -m pip install -q -e .
  fi
  touch "$stamp"
fi
