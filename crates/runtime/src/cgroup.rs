//! cgroup drivers (v1: one hierarchy per controller; v2: unified).
