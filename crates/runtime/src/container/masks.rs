//! Paths masked or made read-only inside every container (Docker's lists, a little stricter).

/// Made unreadable: files get `/dev/null` bound over them, directories an empty read-only tmpfs.
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/proc/sysrq-trigger",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/sys/kernel/debug",
    "/sys/kernel/security",
];

/// Bound read-only onto themselves.
pub const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];
