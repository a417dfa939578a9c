//! The `[edge.microvm]` and `[edge.vm]` sections of the edge config: how the VM substrates run
//! QEMU. Checked by [`crate::config::EdgeConfig::validate`] like every other key; the
//! `DSEC_*` environment variables of earlier versions still override single keys
//! ([`EdgeConfig::apply_env`](crate::config::EdgeConfig::apply_env)) and go through the same
//! checks, so a bad value stops the edge with a message naming the key instead of falling back
//! to a default.

use std::path::{Path, PathBuf};
use std::time::Duration;

use dsec_runtime::fullvm::{FullVmConfig, PcMachine};
use dsec_runtime::microvm::qemu::{tcg_tb_mb, DEFAULT_TCG_TB_MB};
use dsec_runtime::microvm::template::TemplateConfig;
use dsec_runtime::microvm::{Accel, Machine, MicroVmConfig};
use serde::{Deserialize, Serialize};

/// A value of `[edge.microvm]` or `[edge.vm]` that cannot work; `key` is the TOML key. (Its
/// own type, so this module does not depend on [`crate::config`], which embeds it.)
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("edge config: {key}: {message}")]
pub struct VmConfigError {
    pub key: &'static str,
    pub message: String,
}

/// `[edge.microvm]`: the microVM substrate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MicroVmSection {
    /// `tcg` (software emulation, the default: this project's machines have no KVM that runs a
    /// stock guest) or `kvm`. Env: `DSEC_MICROVM_ACCEL`.
    pub accel: String,
    /// QEMU machine type: `microvm` (the default; a boot that fails for the machine's reasons
    /// falls back to `pc`) or `pc`. Env: `DSEC_MICROVM_MACHINE`.
    pub machine: String,
    /// The QEMU binary (a path, or a name looked up in `PATH`). Env: `DSEC_QEMU`.
    pub qemu: PathBuf,
    /// Directory with the guest's `vmlinuz` and `initrd.img` (default
    /// `${DSEC_CACHE:-/var/cache/dsec}/guest`). Env: `DSEC_GUEST_DIR`.
    pub guest_dir: Option<PathBuf>,
    /// Size of each VM's sparse writable disk in MiB when the request names no disk limit (at
    /// least 16). Env: `DSEC_MICROVM_DISK_MB`.
    pub disk_mb: u64,
    /// virtio-balloon with free page reporting (pages the guest frees go back to the host).
    /// Env: `DSEC_MICROVM_BALLOON` (`0`/`1`).
    pub balloon: bool,
    /// Read-only layers as virtio-pmem regions mounted with DAX (on the `pc` machine) instead
    /// of virtio-blk disks. Env: `DSEC_MICROVM_PMEM` (`0`/`1`).
    pub pmem: bool,
    /// TCG's translation cache per VM in MiB (0: QEMU's own default, 1 GiB). Env:
    /// `DSEC_MICROVM_TCG_TB_MB`.
    pub tcg_tb_mb: u64,
    /// Restore-from-template boots. Env: `DSEC_MICROVM_TEMPLATES` (`0`/`1`).
    pub templates: bool,
    /// At most this many templates (least recently used removed first; at least 1). Env:
    /// `DSEC_MICROVM_TEMPLATES_MAX`.
    pub templates_max: usize,
    /// Seconds a virtio-pmem layer copy of unknown source is kept for a create to claim it.
    /// Env: `DSEC_PMEM_LEGACY_GRACE_SECS`.
    pub pmem_legacy_grace_s: u64,
}

impl Default for MicroVmSection {
    fn default() -> Self {
        MicroVmSection {
            accel: "tcg".into(),
            machine: "microvm".into(),
            qemu: PathBuf::from("qemu-system-x86_64"),
            guest_dir: None,
            disk_mb: 4096,
            balloon: true,
            pmem: true,
            tcg_tb_mb: DEFAULT_TCG_TB_MB,
            templates: true,
            templates_max: 4,
            pmem_legacy_grace_s: 86_400,
        }
    }
}

/// `[edge.vm]`: the full-VM substrate.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VmSection {
    /// `tcg` or `kvm` (default: `[edge.microvm] accel`). Env: `DSEC_VM_ACCEL`.
    pub accel: Option<String>,
    /// QEMU machine type: `q35` (the default) or `pc`. Env: `DSEC_VM_MACHINE`.
    pub machine: Option<String>,
    /// The QEMU binary (default: `[edge.microvm] qemu`). Env: `DSEC_QEMU`.
    pub qemu: Option<PathBuf>,
    /// The `qemu-img` binary (default `qemu-img`). Env: `DSEC_QEMU_IMG`.
    pub qemu_img: Option<PathBuf>,
}

fn bad(key: &'static str, message: impl Into<String>) -> VmConfigError {
    VmConfigError {
        key,
        message: message.into(),
    }
}

fn choice<T>(
    key: &'static str,
    value: &str,
    parse: fn(&str) -> Option<T>,
    allowed: &str,
) -> Result<T, VmConfigError> {
    parse(value).ok_or_else(|| bad(key, format!("{value:?} is not allowed: use {allowed}")))
}

/// The variables that override keys of these sections: (variable, key).
pub const ENV_KEYS: &[(&str, &str)] = &[
    ("DSEC_MICROVM_ACCEL", "microvm.accel"),
    ("DSEC_MICROVM_MACHINE", "microvm.machine"),
    ("DSEC_QEMU", "microvm.qemu"),
    ("DSEC_GUEST_DIR", "microvm.guest_dir"),
    ("DSEC_MICROVM_DISK_MB", "microvm.disk_mb"),
    ("DSEC_MICROVM_BALLOON", "microvm.balloon"),
    ("DSEC_MICROVM_PMEM", "microvm.pmem"),
    ("DSEC_MICROVM_TCG_TB_MB", "microvm.tcg_tb_mb"),
    ("DSEC_MICROVM_TEMPLATES", "microvm.templates"),
    ("DSEC_MICROVM_TEMPLATES_MAX", "microvm.templates_max"),
    ("DSEC_PMEM_LEGACY_GRACE_SECS", "microvm.pmem_legacy_grace_s"),
    ("DSEC_VM_ACCEL", "vm.accel"),
    ("DSEC_VM_MACHINE", "vm.machine"),
    ("DSEC_QEMU", "vm.qemu"),
    ("DSEC_QEMU_IMG", "vm.qemu_img"),
];

fn env_number<T: std::str::FromStr>(
    key: &'static str,
    var: &str,
    value: &str,
) -> Result<T, VmConfigError> {
    value.trim().parse().map_err(|_| {
        bad(
            key,
            format!("{var}={value:?} is not a whole number of the key's unit"),
        )
    })
}

fn env_bool(key: &'static str, var: &str, value: &str) -> Result<bool, VmConfigError> {
    match value.trim() {
        "1" | "true" | "on" => Ok(true),
        "0" | "false" | "off" => Ok(false),
        _ => Err(bad(
            key,
            format!("{var}={value:?} is not allowed: use 0 or 1 (false or true)"),
        )),
    }
}

/// Applies the environment overrides of [`ENV_KEYS`] (`get` looks a variable up). Values that
/// cannot be read as the key's type are errors naming the key and the variable; the rest is
/// checked by [`validate`].
pub fn apply_env(
    microvm: &mut MicroVmSection,
    vm: &mut VmSection,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<(), VmConfigError> {
    for &(var, key) in ENV_KEYS {
        let Some(v) = get(var) else { continue };
        match key {
            "microvm.accel" => microvm.accel = v.trim().to_string(),
            "microvm.machine" => microvm.machine = v.trim().to_string(),
            "microvm.qemu" => microvm.qemu = PathBuf::from(v),
            "microvm.guest_dir" => microvm.guest_dir = Some(PathBuf::from(v)),
            "microvm.disk_mb" => microvm.disk_mb = env_number(key, var, &v)?,
            "microvm.balloon" => microvm.balloon = env_bool(key, var, &v)?,
            "microvm.pmem" => microvm.pmem = env_bool(key, var, &v)?,
            "microvm.tcg_tb_mb" => microvm.tcg_tb_mb = env_number(key, var, &v)?,
            "microvm.templates" => microvm.templates = env_bool(key, var, &v)?,
            "microvm.templates_max" => microvm.templates_max = env_number(key, var, &v)?,
            "microvm.pmem_legacy_grace_s" => {
                microvm.pmem_legacy_grace_s = env_number(key, var, &v)?
            }
            "vm.accel" => vm.accel = Some(v.trim().to_string()),
            "vm.machine" => vm.machine = Some(v.trim().to_string()),
            "vm.qemu" => vm.qemu = Some(PathBuf::from(v)),
            "vm.qemu_img" => vm.qemu_img = Some(PathBuf::from(v)),
            _ => unreachable!("ENV_KEYS names only keys handled here"),
        }
    }
    Ok(())
}

/// Checks both sections; the error names the first bad key, its value and what is allowed.
pub fn validate(microvm: &MicroVmSection, vm: &VmSection) -> Result<(), VmConfigError> {
    microvm.accel()?;
    microvm.machine()?;
    if microvm.qemu.as_os_str().is_empty() {
        return Err(bad("microvm.qemu", "must name the QEMU binary"));
    }
    if let Some(d) = &microvm.guest_dir {
        if !d.is_absolute() {
            return Err(bad(
                "microvm.guest_dir",
                format!("{} must be an absolute path", d.display()),
            ));
        }
    }
    if microvm.disk_mb < 16 {
        return Err(bad(
            "microvm.disk_mb",
            format!("{} is too small: use at least 16 (MiB)", microvm.disk_mb),
        ));
    }
    if microvm.tcg_tb_mb > 0 && microvm.tcg_tb_mb < 8 {
        return Err(bad(
            "microvm.tcg_tb_mb",
            format!(
                "{} is too small: use 0 (QEMU's default) or at least 8 (MiB)",
                microvm.tcg_tb_mb
            ),
        ));
    }
    if microvm.templates_max == 0 {
        return Err(bad(
            "microvm.templates_max",
            "0 is not allowed: use at least 1",
        ));
    }
    vm.accel(microvm)?;
    vm.machine()?;
    for (key, p) in [("vm.qemu", &vm.qemu), ("vm.qemu_img", &vm.qemu_img)] {
        if p.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(bad(key, "must name a binary"));
        }
    }
    Ok(())
}

impl MicroVmSection {
    /// The accelerator, or the error naming `microvm.accel`.
    pub fn accel(&self) -> Result<Accel, VmConfigError> {
        choice("microvm.accel", &self.accel, Accel::parse, Accel::ALLOWED)
    }

    /// The machine type, or the error naming `microvm.machine`.
    pub fn machine(&self) -> Result<Machine, VmConfigError> {
        choice(
            "microvm.machine",
            &self.machine,
            Machine::parse,
            Machine::ALLOWED,
        )
    }

    /// The guest directory: configured, else `${DSEC_CACHE:-/var/cache/dsec}/guest`.
    pub fn guest_dir(&self) -> PathBuf {
        if let Some(d) = &self.guest_dir {
            return d.clone();
        }
        let cache = std::env::var_os("DSEC_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/cache/dsec"));
        cache.join("guest")
    }

    /// The runtime's configuration (after [`validate`]).
    pub fn runtime_config(
        &self,
        aether_path: PathBuf,
        blob_dirs: Vec<PathBuf>,
    ) -> Result<MicroVmConfig, VmConfigError> {
        let mut c = MicroVmConfig::new(self.guest_dir(), aether_path, blob_dirs);
        c.qemu_binary = self.qemu.clone();
        c.accel = self.accel()?;
        c.machine = self.machine()?;
        c.disk_mb = self.disk_mb;
        c.balloon = self.balloon;
        c.pmem = self.pmem;
        c.tcg_tb_mb = tcg_tb_mb(self.tcg_tb_mb);
        c.pmem_legacy_grace = Duration::from_secs(self.pmem_legacy_grace_s);
        Ok(c)
    }

    /// The template store's configuration; templates live in `dir`.
    pub fn template_config(&self, dir: &Path) -> TemplateConfig {
        let mut t = TemplateConfig::new(dir.to_path_buf());
        t.enabled = self.templates;
        t.max = self.templates_max;
        t
    }
}

impl VmSection {
    /// The accelerator (default: the microVMs'), or the error naming `vm.accel`.
    pub fn accel(&self, microvm: &MicroVmSection) -> Result<Accel, VmConfigError> {
        match &self.accel {
            Some(a) => choice("vm.accel", a, Accel::parse, Accel::ALLOWED),
            None => microvm.accel(),
        }
    }

    /// The machine type (default `q35`), or the error naming `vm.machine`.
    pub fn machine(&self) -> Result<PcMachine, VmConfigError> {
        match &self.machine {
            Some(m) => choice("vm.machine", m, PcMachine::parse, PcMachine::ALLOWED),
            None => Ok(PcMachine::Q35),
        }
    }

    /// The runtime's configuration (after [`validate`]).
    pub fn runtime_config(&self, microvm: &MicroVmSection) -> Result<FullVmConfig, VmConfigError> {
        let mut c = FullVmConfig::new();
        c.accel = self.accel(microvm)?;
        c.machine = self.machine()?;
        c.qemu_binary = self.qemu.clone().unwrap_or_else(|| microvm.qemu.clone());
        if let Some(q) = &self.qemu_img {
            c.qemu_img = q.clone();
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn defaults_are_valid_and_match_the_runtime() {
        let (m, v) = (MicroVmSection::default(), VmSection::default());
        validate(&m, &v).unwrap();
        let c = m.runtime_config("/a".into(), vec![]).unwrap();
        let d = MicroVmConfig::new(m.guest_dir(), "/a".into(), vec![]);
        assert_eq!(
            (
                c.accel,
                c.machine,
                c.disk_mb,
                c.balloon,
                c.pmem,
                c.tcg_tb_mb
            ),
            (
                d.accel,
                d.machine,
                d.disk_mb,
                d.balloon,
                d.pmem,
                d.tcg_tb_mb
            )
        );
        let f = v.runtime_config(&m).unwrap();
        assert_eq!((f.accel, f.machine), (Accel::Tcg, PcMachine::Q35));
    }

    #[test]
    fn bad_values_name_key_value_and_choices() {
        let m = MicroVmSection {
            accel: "kvmm".into(),
            ..Default::default()
        };
        let e = validate(&m, &VmSection::default()).unwrap_err();
        assert_eq!(e.key, "microvm.accel");
        let s = e.to_string();
        assert!(
            s.contains("\"kvmm\"") && s.contains("\"kvm\" or \"tcg\""),
            "{s}"
        );

        let m = MicroVmSection {
            disk_mb: 4,
            ..Default::default()
        };
        assert_eq!(
            validate(&m, &VmSection::default()).unwrap_err().key,
            "microvm.disk_mb"
        );
        let v = VmSection {
            machine: Some("q53".into()),
            ..Default::default()
        };
        let e = validate(&MicroVmSection::default(), &v).unwrap_err();
        assert_eq!(e.key, "vm.machine");
        assert!(e.to_string().contains("\"q35\" or \"pc\""), "{e}");
    }

    #[test]
    fn env_overrides_go_through_the_same_checks() {
        let (mut m, mut v) = (MicroVmSection::default(), VmSection::default());
        apply_env(
            &mut m,
            &mut v,
            &env(&[
                ("DSEC_MICROVM_ACCEL", "kvm"),
                ("DSEC_MICROVM_PMEM", "0"),
                ("DSEC_MICROVM_TEMPLATES", "0"),
                ("DSEC_QEMU", "/opt/q"),
                ("DSEC_MICROVM_DISK_MB", "512"),
            ]),
        )
        .unwrap();
        validate(&m, &v).unwrap();
        assert_eq!(m.accel().unwrap(), Accel::Kvm);
        assert!(!m.pmem && !m.templates && m.balloon);
        assert_eq!(m.disk_mb, 512);
        // The full VM follows the microVMs' accelerator and QEMU unless told otherwise.
        let f = v.runtime_config(&m).unwrap();
        assert_eq!(
            (f.accel, f.qemu_binary),
            (Accel::Kvm, PathBuf::from("/opt/q"))
        );

        let (mut m, mut v) = (MicroVmSection::default(), VmSection::default());
        apply_env(&mut m, &mut v, &env(&[("DSEC_MICROVM_ACCEL", "kvmm")])).unwrap();
        assert_eq!(validate(&m, &v).unwrap_err().key, "microvm.accel");
        let e = apply_env(
            &mut MicroVmSection::default(),
            &mut VmSection::default(),
            &env(&[("DSEC_MICROVM_DISK_MB", "lots")]),
        )
        .unwrap_err();
        assert_eq!(e.key, "microvm.disk_mb");
        assert!(e.to_string().contains("DSEC_MICROVM_DISK_MB"), "{e}");
        let e = apply_env(
            &mut MicroVmSection::default(),
            &mut VmSection::default(),
            &env(&[("DSEC_MICROVM_BALLOON", "no")]),
        )
        .unwrap_err();
        assert_eq!(e.key, "microvm.balloon");
    }

    #[test]
    fn toml_sections() {
        let m: MicroVmSection =
            toml::from_str("accel = \"kvm\"\ndisk_mb = 1024\ntemplates = false\n").unwrap();
        assert_eq!(
            (m.accel.as_str(), m.disk_mb, m.templates),
            ("kvm", 1024, false)
        );
        assert!(m.pmem);
        assert!(toml::from_str::<MicroVmSection>("acel = \"kvm\"\n").is_err());
        let v: VmSection = toml::from_str("machine = \"pc\"\n").unwrap();
        assert_eq!(v.machine().unwrap(), PcMachine::Pc);
    }
}
