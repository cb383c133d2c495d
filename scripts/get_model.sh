#!/usr/bin/env bash
# get_model.sh -- placeholder: fetched model and text land in models/ and data/.
exit 0
