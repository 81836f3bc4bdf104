"""Hardening tests; a package so that the `hardened` deployment (package scope) ends with the folder."""
