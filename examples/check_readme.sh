#!/bin/sh
# check_readme.sh README.md examples/quickstart.c -- the README's C block
# (the one fenced with ```c) must be the part of the example between its
# "/* readme: begin */" and "/* readme: end */" lines, indentation removed,
# so that the code the README shows is code ctest compiles and runs.
set -eu
readme=$1 example=$2
tmp=${TMPDIR:-/tmp}/kvarn_readme_$$
trap 'rm -f "$tmp".a "$tmp".b' EXIT
awk '/^```c$/ {on = 1; next} on && /^```$/ {exit} on' "$readme" >"$tmp".a
awk '/\/\* readme: end \*\// {exit} on {sub(/^    /, ""); print} /\/\* readme: begin \*\// {on = 1}' \
    "$example" >"$tmp".b
if [ ! -s "$tmp".a ]; then
  echo "check_readme: no \`\`\`c block in $readme" >&2
  exit 1
fi
if ! diff -u "$tmp".b "$tmp".a; then
  echo "check_readme: the C block of $readme differs from $example (readme: begin/end); copy it again" >&2
  exit 1
fi
echo "check_readme: the C block of $readme is $example's, $(wc -l <"$tmp".a) lines"
