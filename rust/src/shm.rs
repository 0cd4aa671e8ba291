//! Named POSIX shared-memory regions (`shm_open` + `mmap`) and process liveness checks, so
//! several worker processes can share one set of limits and reclaim what a dead worker held.

use std::ffi::CString;
use std::ptr::NonNull;

use crate::error::CoreError;

/// A `MAP_SHARED` mapping of a named shared-memory object. The creator (`owner`) unlinks the
/// name when dropped; every mapping is unmapped when dropped.
#[derive(Debug)]
pub struct ShmMapping {
    ptr: NonNull<u8>,
    len: usize,
    name: CString,
    owner: bool,
}

// SAFETY: the mapping is plain memory; what lives in it is made only of atomics.
unsafe impl Send for ShmMapping {}
// SAFETY: idem.
unsafe impl Sync for ShmMapping {}

/// Normalises a user-given name to the `/name` form `shm_open` wants.
pub fn normalize_name(name: &str) -> Result<CString, CoreError> {
    let trimmed = name.strip_prefix('/').unwrap_or(name);
    if trimmed.is_empty() || trimmed.len() > 200 || trimmed.contains('/') || trimmed.contains('\0')
    {
        return Err(CoreError::SharedState(format!(
            "invalid shared-memory name {name:?}: 1..200 characters, no '/' after the first"
        )));
    }
    CString::new(format!("/{trimmed}")).map_err(|e| CoreError::SharedState(e.to_string()))
}

fn os_err(what: &str, name: &CString) -> CoreError {
    CoreError::SharedState(format!(
        "{what} of shared memory {:?} failed: {}",
        name,
        std::io::Error::last_os_error()
    ))
}

impl ShmMapping {
    /// Creates the object `name` with `len` zeroed bytes and maps it. An existing object of the
    /// same name is replaced (unlinked first): a stale region from a crashed run is not reused.
    pub fn create(name: &str, len: usize) -> Result<Self, CoreError> {
        let cname = normalize_name(name)?;
        // SAFETY: cname is a valid C string.
        unsafe {
            libc::shm_unlink(cname.as_ptr());
        }
        // SAFETY: valid C string and flags.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_err("shm_open(create)", &cname));
        }
        // SAFETY: fd is a valid descriptor we own.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = os_err("ftruncate", &cname);
            // SAFETY: fd valid; name valid.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
            }
            return Err(e);
        }
        Self::map(fd, len, cname, true)
    }

    /// Opens and maps the existing object `name`, which must be at least `len` bytes.
    pub fn open(name: &str, len: usize) -> Result<Self, CoreError> {
        let cname = normalize_name(name)?;
        // SAFETY: valid C string and flags.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(os_err("shm_open(attach)", &cname));
        }
        // SAFETY: zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd valid, st writable.
        if unsafe { libc::fstat(fd, &raw mut st) } != 0 {
            let e = os_err("fstat", &cname);
            // SAFETY: fd valid.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        if (st.st_size as u64) < len as u64 {
            // SAFETY: fd valid.
            unsafe { libc::close(fd) };
            return Err(CoreError::SharedState(format!(
                "shared memory {cname:?} is {} bytes, expected {len}: not a kvgate region of this \
                 version",
                st.st_size
            )));
        }
        Self::map(fd, len, cname, false)
    }

    fn map(fd: libc::c_int, len: usize, name: CString, owner: bool) -> Result<Self, CoreError> {
        // SAFETY: fd is valid and at least len bytes long; we ask for a fresh shared mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: fd valid; the mapping (if any) stays valid after close.
        unsafe { libc::close(fd) };
        if ptr == libc::MAP_FAILED {
            return Err(os_err("mmap", &name));
        }
        Ok(Self {
            ptr: NonNull::new(ptr.cast::<u8>()).expect("mmap returned null"),
            len,
            name,
            owner,
        })
    }

    /// Start of the mapping (page aligned).
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Whether this mapping created the object (and unlinks it on drop).
    pub fn is_owner(&self) -> bool {
        self.owner
    }

    /// The `/name` of the object.
    pub fn name(&self) -> &str {
        self.name.to_str().unwrap_or("")
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping we made; nothing borrows it past drop (the owner of
        // this value guarantees that).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
            if self.owner {
                libc::shm_unlink(self.name.as_ptr());
            }
        }
    }
}

/// The start time of process `pid` (clock ticks since boot, field 22 of `/proc/<pid>/stat`),
/// used with the pid to tell a live process from a new one that reused the pid. `None` when the
/// process does not exist (or on systems without `/proc`).
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process `pid` that started at `start_time` is still alive (not a zombie, and not
/// a different process that reused the pid).
pub fn process_alive(pid: u32, start_time: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        // No /proc entry: check with kill(0) (covers systems without /proc).
        // SAFETY: signal 0 only checks for existence.
        let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
        return r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    };
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut fields = stat[close + 1..].split_whitespace();
    let state = fields.next().unwrap_or("X");
    if state == "Z" || state == "X" {
        return false;
    }
    let started: Option<u64> = fields.nth(18).and_then(|s| s.parse().ok());
    started == Some(start_time)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_share_bytes() {
        let name = format!("kvgate-test-shm-{}", std::process::id());
        let a = ShmMapping::create(&name, 4096).unwrap();
        let b = ShmMapping::open(&name, 4096).unwrap();
        // SAFETY: both map the same 4096 bytes.
        unsafe {
            *a.as_ptr().as_ptr() = 42;
            assert_eq!(*b.as_ptr().as_ptr(), 42);
        }
        assert!(ShmMapping::open(&name, 8192).is_err());
        drop(a);
        assert!(
            ShmMapping::open(&name, 4096).is_err(),
            "owner unlinks on drop"
        );
        drop(b);
        assert!(normalize_name("a/b").is_err());
        assert!(normalize_name("").is_err());
    }

    #[test]
    fn liveness() {
        let me = std::process::id();
        let st = process_start_time(me).unwrap();
        assert!(process_alive(me, st));
        assert!(!process_alive(me, st + 1));
        assert!(!process_alive(0x3fff_fff0, 0));
    }
}
