//! Creating a container: the spec checked, its cgroup and directories made, aether spawned
//! into new namespaces and set up over its channel; on error everything built so far is
//! rolled back.

use super::*;

impl ContainerSubstrate {
    /// Builds and starts a container; on error everything built so far is removed.
    pub async fn create(&self, spec: SandboxSpec) -> Result<ContainerSandbox, CreateSandboxError> {
        self.create_with(spec, SchedClass::Inherit).await
    }

    /// [`Substrate::create`] with the scheduling class the container's processes start in
    /// (set by the spawn child before aether execs, inherited by everything it forks).
    pub async fn create_with(
        &self,
        spec: SandboxSpec,
        sched: SchedClass,
    ) -> Result<ContainerSandbox, CreateSandboxError> {
        validate_spec(&spec)?;
        let id = spec.id.clone();
        let limits = Limits {
            memory_bytes: spec.memory_limit_mb.saturating_mul(1 << 20),
            cpu_cores: spec.cpu_cores_limit,
            pids: spec.pids_limit,
        };
        let root = self.cgroup_root.clone();
        let parent = self.config.cgroup_parent.clone();
        let cg_id = id.clone();
        let cgroup =
            tokio::task::spawn_blocking(move || Cgroup::create(&root, &parent, &cg_id, &limits))
                .await
                .map_err(|e| CreateSandboxError::Cgroup {
                    id: id.clone(),
                    source: io::Error::other(e),
                })?
                .map_err(|e| CreateSandboxError::Cgroup {
                    id: id.clone(),
                    source: io::Error::other(e),
                })?;
        // The writable layer's size limit: a file system of its own, capped on its device. It
        // exists before anything is written into the layer: the edge's files come after it.
        let disk = spec.disk_limit_mb.filter(|mb| *mb > 0);
        if disk.is_some() || !spec.layer_files.is_empty() {
            let dir = spec.dir.clone();
            let bps = self.disk_bps;
            let cg = cgroup.clone();
            let files = spec.layer_files.clone();
            let made = tokio::task::spawn_blocking(move || {
                if let Some(mb) = disk {
                    disk::prepare(&dir, mb, bps).map(|()| disk::throttle_v2(&cg, &dir, bps))?;
                }
                write_layer_files(&dir.join("upper"), &files)
            })
            .await;
            let err = match made {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(e) => Some(CreateSandboxError::Spawn(io::Error::other(e))),
            };
            if let Some(error) = err {
                let dir = spec.dir.clone();
                let cg = cgroup.clone();
                // prepare removed what it built; the cgroup is empty.
                let _ = tokio::task::spawn_blocking(move || {
                    if disk.is_some() {
                        disk::release(&dir);
                    }
                    remove_dead_cgroup(&cg)
                })
                .await;
                return Err(error);
            }
        }
        let dirs = SandboxDirs::new(&spec.dir);
        match self.start(&spec, &cgroup, &dirs, sched).await {
            Ok(Started { process, client }) => {
                // The edge logs "sandbox created" (with the pid) at INFO.
                tracing::debug!(sandbox = %id, pid = process.pid, "container started");
                let mnt_ns = mntns::MountNsHold::open(process.pid, &id);
                Ok(ContainerSandbox {
                    id,
                    process,
                    client,
                    cgroup,
                    dirs,
                    mnt_ns: std::sync::Mutex::new(mnt_ns),
                })
            }
            Err((error, process)) => {
                tracing::warn!(sandbox = %id, error = %error, "container create failed, rolling back");
                let mut cleanup = Vec::new();
                if let Some(p) = process {
                    if let Err(e) = p.kill().await {
                        cleanup.push(e.to_string());
                    }
                }
                if let Err(e) = teardown(cgroup, dirs).await {
                    cleanup.push(e.to_string());
                }
                if disk.is_some() {
                    let dir = spec.dir.clone();
                    if let Err(e) = tokio::task::spawn_blocking(move || disk::release(&dir)).await {
                        cleanup.push(format!("release disk limit: {e}"));
                    }
                }
                if cleanup.is_empty() {
                    Err(error)
                } else {
                    Err(CreateSandboxError::WithCleanup {
                        id,
                        error: Box::new(error),
                        cleanup: cleanup.join("; "),
                    })
                }
            }
        }
    }

    fn setup_for(
        &self,
        spec: &SandboxSpec,
        dirs: &SandboxDirs,
    ) -> Result<ContainerSetup, CreateSandboxError> {
        let s = |p: &Path| {
            p.to_str().map(str::to_string).ok_or_else(|| {
                CreateSandboxError::InvalidSpec(format!("path is not UTF-8: {}", p.display()))
            })
        };
        Ok(ContainerSetup {
            sandbox_id: spec.id.clone(),
            hostname: spec.hostname.clone(),
            lowers: spec.lowers.iter().map(|p| s(p)).collect::<Result<_, _>>()?,
            upper: s(&dirs.upper)?,
            work: s(&dirs.work)?,
            rootfs: s(&dirs.rootfs)?,
            masked_paths: self.masked_paths.clone(),
            readonly_paths: self.readonly_paths.clone(),
            user: spec.user.clone(),
            env: spec.env.clone(),
            shm_mb: self.config.shm_mb,
            reattach_grace_ms: self.reattach_grace_ms,
            protected_paths: spec.protected_paths.clone(),
            binds: spec
                .binds
                .iter()
                .map(|b| {
                    Ok(dsec_wire::aether::BindSetup {
                        source: s(&b.source)?,
                        target: b.target.clone(),
                        read_only: b.read_only,
                    })
                })
                .collect::<Result<_, CreateSandboxError>>()?,
        })
    }

    /// Everything after the cgroup exists. On error, returns what must be rolled back.
    async fn start(
        &self,
        spec: &SandboxSpec,
        cgroup: &Cgroup,
        dirs: &SandboxDirs,
        sched: SchedClass,
    ) -> Result<Started, (CreateSandboxError, Option<Process>)> {
        let setup = self.setup_for(spec, dirs).map_err(|e| (e, None))?;
        dirs.create()
            .map_err(|e| (CreateSandboxError::Spawn(e), None))?;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| (CreateSandboxError::Spawn(e), None))?;
        let listener = if self.reattach_grace_ms > 0 {
            Some(
                adopt::bind_listener(&spec.dir)
                    .map_err(|e| (CreateSandboxError::Spawn(e), None))?,
            )
        } else {
            None
        };
        let aether = self.config.aether_path.clone();
        let procs = cgroup.procs_files();
        let user_procs = cgroup.user_procs_file();
        // A prepared namespace (networking) or a fresh empty one from the pool, else the clone
        // makes one.
        let netns = spec.netns.clone().or_else(|| {
            self.netns_pool
                .as_ref()
                .and_then(|p| p.take())
                .map(Arc::new)
        });
        let spawned = tokio::task::spawn_blocking(move || {
            let r = spawn::spawn_aether(
                &aether,
                &procs,
                theirs.as_fd(),
                listener.as_ref().map(|l| l.as_fd()),
                user_procs.as_deref(),
                netns.as_deref().map(|n| n.as_fd()),
                sched,
            );
            drop(theirs);
            drop(listener);
            r
        })
        .await
        .map_err(|e| (CreateSandboxError::Spawn(io::Error::other(e)), None))?
        .map_err(|e| (CreateSandboxError::Spawn(e), None))?;
        let pidfd = Arc::new(spawned.pidfd);
        // The watcher reaps aether; without it we must reap by hand.
        let exit = match pidfd::watch_exit(&pidfd) {
            Ok(rx) => rx,
            Err(e) => {
                let _ = pidfd::send_signal(pidfd.as_fd(), libc::SIGKILL);
                let _ = pidfd::wait_blocking(pidfd.as_fd());
                return Err((CreateSandboxError::Spawn(e), None));
            }
        };
        let process = Process {
            pid: spawned.pid,
            pidfd,
            exit,
        };
        let stream = ours
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(ours))
            .map_err(|e| (CreateSandboxError::Spawn(e), Some(process.clone())))?;
        let client = AetherClient::new(stream);
        let answer = tokio::time::timeout(
            SETUP_TIMEOUT,
            client.request(Request::Setup(setup), Bytes::new()),
        )
        .await;
        let err = match answer {
            Ok(Ok((Reply::Ready { .. }, _))) => return Ok(Started { process, client }),
            Ok(Ok((other, _))) => format!("unexpected answer to Setup: {other:?}"),
            Ok(Err(ChannelError::Aether(e))) if e.kind == AetherErrorKind::BadRequest => {
                return Err((CreateSandboxError::InvalidSpec(e.message), Some(process)));
            }
            Ok(Err(ChannelError::Aether(e))) => e.message,
            Ok(Err(e)) => match process.exit_status() {
                Some(exit) => format!("{e} (aether ended: {exit:?})"),
                None => e.to_string(),
            },
            Err(_) => format!("no answer to Setup within {} s", SETUP_TIMEOUT.as_secs()),
        };
        Err((CreateSandboxError::Setup(err), Some(process)))
    }
}

struct Started {
    process: Process,
    client: AetherClient,
}

/// Checks a spec before anything is built.
pub fn validate_spec(spec: &SandboxSpec) -> Result<(), CreateSandboxError> {
    let bad = |m: String| Err(CreateSandboxError::InvalidSpec(m));
    if !dsec_wire::id::is_valid_sandbox_id(&spec.id) {
        return bad(format!("malformed sandbox id {:?}", spec.id));
    }
    let h = &spec.hostname;
    if h.is_empty()
        || h.len() > 64
        || !h
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return bad(format!(
            "hostname {h:?} must be 1-64 characters of letters, digits, '-' and '.'"
        ));
    }
    if spec.lowers.is_empty() {
        return bad("at least one lower layer is required".into());
    }
    for l in &spec.lowers {
        let s = l.to_string_lossy();
        if !l.is_absolute() || s.contains([':', ',', '\\']) || s.contains('\0') {
            return bad(format!(
                "lower layer path {s:?} must be absolute and free of ':' ',' '\\'"
            ));
        }
        if !l.is_dir() {
            return bad(format!("lower layer {s:?} is not a directory"));
        }
    }
    if !spec.dir.is_absolute() {
        return bad(format!(
            "sandbox dir {} must be absolute",
            spec.dir.display()
        ));
    }
    let ds = spec.dir.to_string_lossy();
    if ds.contains([':', ',', '\\']) {
        return bad(format!("sandbox dir {ds:?} must not contain ':' ',' '\\'"));
    }
    if !(spec.cpu_cores_limit.is_finite() && spec.cpu_cores_limit >= 0.0) {
        return bad(format!(
            "cpu_cores_limit {} must be a non-negative number",
            spec.cpu_cores_limit
        ));
    }
    if spec.memory_limit_mb > (1 << 40) {
        return bad(format!(
            "memory_limit_mb {} is too large",
            spec.memory_limit_mb
        ));
    }
    if spec.user.contains('\0') {
        return bad("user contains a NUL byte".into());
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') {
            return bad(format!("bad environment variable name or value: {k:?}"));
        }
    }
    Ok(())
}

/// Writes [`SandboxSpec::layer_files`] into the writable layer's upper directory (blocking).
fn write_layer_files(upper: &Path, files: &[LayerFile]) -> Result<(), CreateSandboxError> {
    for f in files {
        let rel = Path::new(&f.path);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(CreateSandboxError::InvalidSpec(format!(
                "layer file {:?} must be a relative path without `..`",
                f.path
            )));
        }
        let path = upper.join(rel);
        let written = match path.parent() {
            Some(parent) => std::fs::create_dir_all(parent),
            None => Ok(()),
        }
        .and_then(|()| std::fs::write(&path, &f.contents));
        written.map_err(|source| CreateSandboxError::LayerFile { path, source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn spec(dir: &Path) -> SandboxSpec {
        SandboxSpec {
            id: "sb-t0-0123456789abcdef".into(),
            hostname: "box-1".into(),
            lowers: vec![PathBuf::from("/")],
            dir: dir.to_path_buf(),
            memory_limit_mb: 256,
            cpu_cores_limit: 1.0,
            pids_limit: 100,
            user: "root".into(),
            env: BTreeMap::new(),
            ..Default::default()
        }
    }

    #[test]
    fn validates_specs() {
        let d = tempfile::tempdir().unwrap();
        assert!(validate_spec(&spec(d.path())).is_ok());
        type Mutation = Box<dyn Fn(&mut SandboxSpec)>;
        let cases: Vec<Mutation> = vec![
            Box::new(|s| s.id = "../etc".into()),
            Box::new(|s| s.hostname = "a b".into()),
            Box::new(|s| s.hostname = String::new()),
            Box::new(|s| s.lowers.clear()),
            Box::new(|s| s.lowers = vec![PathBuf::from("/a:b")]),
            Box::new(|s| s.lowers = vec![PathBuf::from("relative")]),
            Box::new(|s| s.lowers = vec![PathBuf::from("/definitely/missing/layer")]),
            Box::new(|s| s.dir = PathBuf::from("rel")),
            Box::new(|s| s.cpu_cores_limit = f64::NAN),
            Box::new(|s| s.cpu_cores_limit = -1.0),
            Box::new(|s| {
                s.env.insert("A=B".into(), "x".into());
            }),
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut s = spec(d.path());
            f(&mut s);
            assert!(
                matches!(validate_spec(&s), Err(CreateSandboxError::InvalidSpec(_))),
                "case {i}"
            );
        }
    }

    #[test]
    fn setup_message_from_spec() {
        let d = tempfile::tempdir().unwrap();
        let sub = ContainerSubstrate::with_cgroup_root(
            ContainerConfig {
                aether_path: "/x/aether".into(),
                cgroup_parent: "dsec/t".into(),
                shm_mb: 64,
            },
            CgroupRoot {
                version: crate::cgroup::CgroupVersion::V2,
                path: d.path().into(),
            },
        );
        let mut sp = spec(d.path());
        sp.env.insert("FOO".into(), "bar".into());
        let setup = sub.setup_for(&sp, &SandboxDirs::new(d.path())).unwrap();
        assert_eq!(setup.lowers, vec!["/".to_string()]);
        assert_eq!(PathBuf::from(&setup.upper), d.path().join("upper"));
        assert_eq!(PathBuf::from(&setup.rootfs), d.path().join("rootfs"));
        assert_eq!(setup.shm_mb, 64);
        assert_eq!(setup.env.get("FOO").map(String::as_str), Some("bar"));
        assert!(setup.masked_paths.iter().any(|p| p == "/proc/kpagecgroup"));
        assert!(setup.readonly_paths.iter().any(|p| p == "/proc/sys"));
    }
}
