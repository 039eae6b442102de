"""The always-on root daemon: process discovery, low-rate rolling windows with retention, on-demand
high-resolution captures over a root-only control socket, and the live view."""
