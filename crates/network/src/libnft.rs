//! nftables transactions inside the edge's own process, through libnftables.
//!
//! Running the `nft` binary costs a fork, an exec and a dynamic link per transaction (≈ 5 ms on
//! a busy 2-core node, against ≈ 0.4 ms for the transaction itself), and a networked create
//! needs one. The edge therefore loads `libnftables.so.1` (the library the `nft` binary is
//! built on, Debian package `libnftables1`) at first use and keeps one context, guarded by a
//! mutex: the library is not thread-safe per context. Where the library cannot be loaded, or
//! `DSEC_NFT_BINARY=1` is set, [`run`] answers `None` and the caller falls back to the binary.
//! Scripts and error text are the same either way.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

use crate::NetError;

type CtxNew = unsafe extern "C" fn(u32) -> *mut c_void;
type CtxFlag = unsafe extern "C" fn(*mut c_void) -> c_int;
type RunCmd = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;
type GetBuf = unsafe extern "C" fn(*mut c_void) -> *const c_char;

struct Lib {
    ctx: *mut c_void,
    run: RunCmd,
    get_error: GetBuf,
    get_output: GetBuf,
}

// SAFETY: the context pointer is only ever used while holding the mutex around `Lib`, so it is
// never touched by two threads at once; libnftables keeps no thread-local state.
unsafe impl Send for Lib {}

static LIB: OnceLock<Option<Mutex<Lib>>> = OnceLock::new();

/// Looks up `name` in `handle` as a function of type `T`.
///
/// # Safety
/// `T` must be the function pointer type of the symbol's real C prototype.
unsafe fn symbol<T: Copy>(handle: *mut c_void, name: &CStr) -> Option<T> {
    // SAFETY: `handle` came from a successful dlopen; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if p.is_null() {
        return None;
    }
    debug_assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `p` is a non-null function address and the caller guarantees `T` matches its
    // prototype (both are pointer-sized).
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn load() -> Option<Mutex<Lib>> {
    if std::env::var_os("DSEC_NFT_BINARY").is_some_and(|v| v != "0") {
        return None;
    }
    // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life.
    let handle = unsafe { libc::dlopen(c"libnftables.so.1".as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        tracing::info!("libnftables.so.1 not loadable: nftables changes run the nft binary");
        return None;
    }
    // SAFETY: the prototypes below are libnftables(3)'s:
    //   struct nft_ctx *nft_ctx_new(uint32_t flags);
    //   int nft_ctx_buffer_output(struct nft_ctx *); int nft_ctx_buffer_error(struct nft_ctx *);
    //   int nft_run_cmd_from_buffer(struct nft_ctx *, const char *);
    //   const char *nft_ctx_get_output_buffer(struct nft_ctx *);
    //   const char *nft_ctx_get_error_buffer(struct nft_ctx *);
    let lib = unsafe {
        let new: CtxNew = symbol(handle, c"nft_ctx_new")?;
        let buffer_output: CtxFlag = symbol(handle, c"nft_ctx_buffer_output")?;
        let buffer_error: CtxFlag = symbol(handle, c"nft_ctx_buffer_error")?;
        let run: RunCmd = symbol(handle, c"nft_run_cmd_from_buffer")?;
        let get_output: GetBuf = symbol(handle, c"nft_ctx_get_output_buffer")?;
        let get_error: GetBuf = symbol(handle, c"nft_ctx_get_error_buffer")?;
        let ctx = new(0);
        if ctx.is_null() || buffer_output(ctx) != 0 || buffer_error(ctx) != 0 {
            return None;
        }
        Lib {
            ctx,
            run,
            get_error,
            get_output,
        }
    };
    Some(Mutex::new(lib))
}

/// Copies a buffer libnftables returned (valid until the next call on the context).
///
/// # Safety
/// `p` is null or a NUL-terminated string owned by the context, which the caller holds.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: see the function's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Runs `script` as one nftables transaction in-process. `None`: the library is unavailable
/// (use the `nft` binary). `Some(Err(_))`: nftables refused the script; the error
/// ([`NetError::Tool`], tool `nft`) carries its message.
pub fn run(script: &str) -> Option<Result<String, NetError>> {
    let lib = LIB.get_or_init(load).as_ref()?;
    let Ok(cmd) = CString::new(script) else {
        return Some(Err(nft_error(
            "the nftables script contains a NUL byte".into(),
        )));
    };
    let lib = lib.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: `lib.ctx` is a live context used only under this lock; `cmd` is NUL-terminated
    // and outlives the call; the buffers are read before the next call on the context (reading
    // them also resets them).
    let (rc, out, err) = unsafe {
        let rc = (lib.run)(lib.ctx, cmd.as_ptr());
        (
            rc,
            text((lib.get_output)(lib.ctx)),
            text((lib.get_error)(lib.ctx)),
        )
    };
    Some(if rc == 0 {
        Ok(out)
    } else {
        Err(nft_error(err.trim().to_string()))
    })
}

fn nft_error(message: String) -> NetError {
    NetError::Tool {
        tool: "nft",
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transactions_and_errors_in_process() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skip: needs root (CAP_NET_ADMIN) for nftables");
            return;
        }
        let t = format!("dsec_libnft{}", std::process::id());
        // Removes the scratch table even when an assertion below panics.
        struct Scratch(String);
        impl Drop for Scratch {
            fn drop(&mut self) {
                let _ = run(&format!("delete table inet {}\n", self.0));
            }
        }
        let Some(made) = run(&format!("add table inet {t}\nadd chain inet {t} c\n")) else {
            eprintln!("skip: libnftables.so.1 is not installed");
            return;
        };
        let _scratch = Scratch(t.clone());
        made.unwrap();
        let listed = run(&format!("list chain inet {t} c\n")).unwrap().unwrap();
        assert!(listed.contains("chain c"), "{listed}");
        // A refused transaction changes nothing and says why.
        let e = run(&format!(
            "add chain inet {t} d\nadd rule inet {t} nosuch accept\n"
        ))
        .unwrap()
        .unwrap_err();
        assert!(e.to_string().contains("No such file or directory"), "{e}");
        assert!(run(&format!("list chain inet {t} d\n")).unwrap().is_err());
        run(&format!("delete table inet {t}\n")).unwrap().unwrap();
    }
}
