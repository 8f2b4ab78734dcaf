"""Switchyard's front door: the ``switchyard`` CLI and the launcher that runs every role.

This package imports the role packages (api_server, scheduler, worker); they never import it.
"""
