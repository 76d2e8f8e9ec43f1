//! OpenBLAS's `cblas_sgemm`, loaded at run time, behind a safe call whose every extent is checked.
//!
//! The library is opened with `dlopen` (libloading) the first time a CPU matmul asks for it, so
//! the binary builds and runs on machines without it (then Flex's own gemm does the work) and
//! picks up Debian's `libopenblas0-pthread` where the README's commands installed it.
//! [`LIBRARY_ENV`] (`ARCHIPELAGO_OPENBLAS_LIBRARY=/path/libopenblas.so.0`) names the library to
//! open instead of searching the default names; if it cannot be loaded there is no OpenBLAS (no
//! fallback to another one).
//!
//! OpenBLAS chooses its kernels (its core type) for the CPU when it is loaded, and may take a CPU
//! newer than itself for an old one (0.3.21 runs Prescott's SSE3 kernels on a Sapphire Rapids,
//! 5× slower than its SkylakeX ones there). The core type is chosen by the rule of
//! [`super::core_type`]: where the detection is older than the CPU's features allow, the library
//! is closed and opened again with [`CORETYPE_ENV`] set from the features (a `dlclose` and
//! `dlopen` re-run OpenBLAS's detection: checked with `openblas_get_corename`, which must then
//! name the core asked for); every candidate must multiply as Flex does
//! (`openblas_check.rs`) or the next is tried. A user's own `OPENBLAS_CORETYPE` is never
//! overridden. [`OpenBlas::description`] says which core runs and why.
//!
//! Only a build that is safe to call from several threads at once is taken: device actors of one
//! process call it concurrently. Debian's `libopenblas0-serial` (`SINGLE_THREADED` in its config)
//! is not — eight threads calling it at once got wrong products in one run of three here — so it
//! is refused with the reason; the threaded build is told to use one thread (one actor per core).
//! A 64-bit-integer build (`USE64BITINT`) has another ABI and is refused too.
//!
//! One of the crate's few `unsafe` modules (with `collectives::shared`, the shm ring and
//! `allocator`): a foreign function reads and writes through raw pointers, so
//! [`OpenBlas::sgemm`] checks that every matrix it is given lies inside its slice before the call;
//! and the core type is passed to OpenBLAS through the environment (see `open_as`).
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int};
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::core_type::{self, Candidate, CpuFeatures};

/// `cblas_sgemm`'s signature (row-major order, transposes and dims as C `int`s: LP64 OpenBLAS).
type SgemmFn = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
);

const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;

/// The names tried, in order (Debian's soname first; its alternatives point it at the threaded
/// build where both are installed).
const LIBRARY_NAMES: [&str; 2] = ["libopenblas.so.0", "libopenblas.so"];

/// Names the OpenBLAS to open (a path or a name `dlopen` searches) instead of the default names.
pub const LIBRARY_ENV: &str = "ARCHIPELAGO_OPENBLAS_LIBRARY";

/// OpenBLAS's own variable that forces its core type (read by its load-time constructor).
pub const CORETYPE_ENV: &str = "OPENBLAS_CORETYPE";

/// A loaded, usable OpenBLAS.
pub struct OpenBlas {
    /// Kept open for as long as the process runs (the function pointer points into it); None
    /// only for the tests' stand-in kernels.
    _library: Option<libloading::Library>,
    sgemm: SgemmFn,
    /// The core type whose kernels run (`openblas_get_corename`), e.g. `SkylakeX`.
    pub core: String,
    /// The core type OpenBLAS chose by itself, loaded without [`CORETYPE_ENV`]; None where the
    /// user set that variable (then nothing is loaded without it).
    pub detected: Option<String>,
    /// What it says of itself and why this core runs: version, build options and the kernels,
    /// e.g. `OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY SkylakeX MAX_THREADS=64
    /// (SkylakeX: core type set from the CPU's features: avx512f …; OpenBLAS detected Prescott)`.
    pub description: String,
}

/// How one operand is laid out: row-major with rows `ld` apart, or the transpose of such a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    /// Whether the matrix is stored transposed (its columns are contiguous).
    pub transposed: bool,
    /// The distance in elements between consecutive stored rows (`lda`/`ldb`).
    pub ld: usize,
}

impl Operand {
    /// The number of elements from the first to one past the last of a `rows × cols` matrix
    /// stored this way.
    fn extent(&self, rows: usize, cols: usize) -> usize {
        let (stored_rows, stored_cols) = if self.transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        if stored_rows == 0 || stored_cols == 0 {
            0
        } else {
            (stored_rows - 1) * self.ld + stored_cols
        }
    }

    fn check(&self, what: &str, rows: usize, cols: usize, len: usize) -> Result<(), String> {
        let stored_cols = if self.transposed { rows } else { cols };
        if self.ld < stored_cols.max(1) {
            return Err(format!(
                "{what}: leading dimension {} below {stored_cols}",
                self.ld
            ));
        }
        let extent = self.extent(rows, cols);
        if extent > len {
            return Err(format!(
                "{what}: a {rows}×{cols} matrix needs {extent} elements, the slice has {len}"
            ));
        }
        Ok(())
    }
}

/// The process's OpenBLAS, loaded on first use, or why there is none.
pub fn library() -> Result<&'static OpenBlas, &'static str> {
    static LOADED: OnceLock<Result<OpenBlas, String>> = OnceLock::new();
    LOADED.get_or_init(load).as_ref().map_err(String::as_str)
}

fn load() -> Result<OpenBlas, String> {
    let (name, first) = open_first()?;
    let user = std::env::var_os(CORETYPE_ENV).map(|v| v.to_string_lossy().into_owned());
    let detected = first.core.clone();
    let features = CpuFeatures::of_this_cpu();
    let candidates = core_type::candidates(user.is_some(), &detected, &features);
    let mut first = Some(first);
    let choice = core_type::first_passing(&candidates, |candidate| {
        let blas = match (candidate, first.take()) {
            (Candidate::AsLoaded, Some(blas)) => blas,
            (candidate, held) => {
                // Closed before it is opened again, so that the next `dlopen` loads it afresh
                // and OpenBLAS's constructor detects (or is told) the core again.
                drop(held);
                open_as(&name, candidate)?
            }
        };
        if let Candidate::Core(core) = candidate
            && !blas.core.eq_ignore_ascii_case(core)
        {
            return Err(format!(
                "OpenBLAS runs {} (this build lacks {core}, or the library was not unloaded)",
                blas.core
            ));
        }
        // Each candidate is checked on its own: a core type whose kernels read C with β = 0 is
        // refused and the next one tried, as is one that multiplies differently from Flex.
        blas.overwrites_c()?;
        super::openblas_check::agrees_with_flex(&blas)?;
        Ok(blas)
    });
    let Some((chosen, mut blas)) = choice.chosen else {
        let refused: Vec<String> = (choice.refused.iter())
            .map(|(c, why)| format!("{c}: {why}"))
            .collect();
        return Err(format!(
            "no OpenBLAS core type multiplies correctly here ({}); use another OpenBLAS, or {} = flex",
            refused.join("; "),
            super::CPU_MATMUL_ENV
        ));
    };
    let why = core_type::reason(chosen, user.as_deref(), &detected, &features, &choice.refused);
    blas.description = format!("{} ({}: {why})", blas.description, blas.core);
    blas.detected = user.is_none().then_some(detected);
    Ok(blas)
}

/// The first library that opens (as the environment says: [`LIBRARY_ENV`] or the default
/// names), with its name.
fn open_first() -> Result<(std::ffi::OsString, OpenBlas), String> {
    if let Some(name) = std::env::var_os(LIBRARY_ENV).filter(|n| !n.is_empty()) {
        return match open(&name) {
            Ok(blas) => Ok((name, blas)),
            Err(e) => Err(format!(
                "OpenBLAS could not be loaded from {LIBRARY_ENV}={} ({e}); point it at an \
                 OpenBLAS such as Debian's libopenblas0-pthread, or unset it to search {}",
                name.to_string_lossy(),
                LIBRARY_NAMES.join(", ")
            )),
        };
    }
    let mut failures = Vec::new();
    for name in LIBRARY_NAMES {
        match open(name.as_ref()) {
            Ok(blas) => return Ok((name.into(), blas)),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "OpenBLAS could not be loaded ({}); install Debian's libopenblas0-pthread, or set \
         {LIBRARY_ENV} to the path of an OpenBLAS",
        failures.join("; ")
    ))
}

/// Opens `name` as `candidate` says: with [`CORETYPE_ENV`] set to its core for the load (and
/// removed again), or with the environment as it is.
///
/// Setting a variable is `unsafe` because C code on another thread may read the environment
/// (`getenv`) while it changes; Rust's own readers take std's lock. OpenBLAS offers no other
/// way to choose its core (no setter; its constructor reads the variable). Why it is sound
/// enough here: it happens only inside [`library`]'s one-time initialisation, which the binary
/// runs from `main` (`kernels::select_from_env`) before any actor, runtime or job thread exists;
/// a `Core` candidate is tried only where the user has not set the variable, so removing it
/// afterwards leaves the environment as it was (and child processes detect for themselves). In
/// a test binary other test threads run meanwhile, and none of them reads the environment from
/// C code but glibc's own rare lookups; glibc 2.36 never frees the strings `setenv` stores,
/// `unsetenv` moves pointers within the array, and an addition reallocates only an array an
/// earlier addition allocated (the first copies the startup array, which stays): such a reader
/// may miss the variable, and only a second candidate's addition could move the array under it.
fn open_as(name: &std::ffi::OsStr, candidate: Candidate) -> Result<OpenBlas, String> {
    let Candidate::Core(core) = candidate else {
        return open(name);
    };
    if std::env::var_os(CORETYPE_ENV).is_some() {
        return Err(format!(
            "{CORETYPE_ENV} is set: the user's choice is not overridden"
        ));
    }
    // SAFETY: see above: once, during the process's one OpenBLAS initialisation, on a variable
    // nobody else sets; the variable is removed again right after the load.
    unsafe { std::env::set_var(CORETYPE_ENV, core) };
    let opened = open(name);
    // SAFETY: as for `set_var`.
    unsafe { std::env::remove_var(CORETYPE_ENV) };
    opened
}

/// `dlopen`s `name` and adopts it (see [`adopt`]).
fn open(name: &std::ffi::OsStr) -> Result<OpenBlas, String> {
    // SAFETY: loading runs OpenBLAS's initialiser, which detects the CPU (or reads
    // OPENBLAS_CORETYPE) and sets up its buffers and thread pool; it has no other effect on this
    // process. Unloading (dropping the library, `dlclose`) runs its destructor, which stops that
    // pool: done only in [`load`] before the library is published, while nothing holds a
    // pointer into it but the `OpenBlas` being dropped.
    let library = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
    adopt(library)
}

fn adopt(library: libloading::Library) -> Result<OpenBlas, String> {
    // SAFETY: the symbols are looked up by their C names and given their C signatures from
    // OpenBLAS's cblas.h and openblas_config.h; the pointers are copied out while `library`
    // stays alive in the returned value.
    let (sgemm, config, corename, set_threads) = unsafe {
        let sgemm = *library
            .get::<SgemmFn>(b"cblas_sgemm\0")
            .map_err(|e| format!("the library has no cblas_sgemm: {e}"))?;
        let config = library
            .get::<unsafe extern "C" fn() -> *const c_char>(b"openblas_get_config\0")
            .map(|f| *f)
            .map_err(|e| format!("not OpenBLAS (no openblas_get_config): {e}"))?;
        let corename = library
            .get::<unsafe extern "C" fn() -> *const c_char>(b"openblas_get_corename\0")
            .map(|f| *f)
            .ok();
        let set_threads = library
            .get::<unsafe extern "C" fn(c_int)>(b"openblas_set_num_threads\0")
            .map(|f| *f)
            .ok();
        (sgemm, config, corename, set_threads)
    };
    // SAFETY: both return pointers to static NUL-terminated strings inside the library.
    let text = |f: unsafe extern "C" fn() -> *const c_char| unsafe {
        let p = f();
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().trim().to_string()
        }
    };
    let config_text = text(config);
    if config_text.contains("SINGLE_THREADED") {
        return Err(format!(
            "{config_text}: a single-threaded OpenBLAS build is not safe to call from several actor \
             threads at once; install Debian's libopenblas0-pthread (it is told to use one thread)"
        ));
    }
    if config_text.contains("USE64BITINT") {
        return Err(format!(
            "{config_text}: a 64-bit-integer OpenBLAS has another ABI"
        ));
    }
    if let Some(set_threads) = set_threads {
        // SAFETY: a plain setter; one thread per call is what one actor per core wants.
        unsafe { set_threads(1) };
    }
    let core = corename.map(text).unwrap_or_default();
    let blas = OpenBlas {
        _library: Some(library),
        sgemm,
        core,
        detected: None,
        description: config_text,
    };
    Ok(blas)
}

impl OpenBlas {
    /// Checks that this build writes `c` with β = 0 without reading it — what
    /// [`OpenBlas::sgemm_batch`] counts on when it hands OpenBLAS memory nothing zeroed (older
    /// OpenBLAS kernels computed `β·c`, which lets a NaN left in reused memory through): products
    /// at the small-matrix and the blocked paths, into a `c` full of NaNs, must come out exact.
    fn overwrites_c(&self) -> Result<(), String> {
        let plain = |ld| Operand {
            transposed: false,
            ld,
        };
        for (m, n, k) in [(1, 1, 1), (3, 5, 2), (7, 9, 13), (64, 48, 40), (130, 70, 96)] {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
            let mut c = vec![f32::NAN; m * n];
            self.sgemm((m, n, k), &a, plain(k), &b, plain(n), &mut c, n)?;
            for (i, got) in c.iter().enumerate() {
                let (row, col) = (i / n, i % n);
                let want: f32 = (0..k).map(|p| a[row * k + p] * b[p * n + col]).sum();
                if *got != want {
                    return Err(format!(
                        "{}: a {m}×{k}·{k}×{n} product into memory holding NaNs gave {got} at ({row}, {col}) instead of {want} (this build reads C with β = 0); use another OpenBLAS, or {} = flex",
                        self.description,
                        super::CPU_MATMUL_ENV
                    ));
                }
            }
        }
        Ok(())
    }

    /// `c[m×n] = a[m×k] · b[k×n]` (overwriting `c`), each matrix read from the start of its slice
    /// as `Operand` says; `c` is row-major with rows `ldc` apart. Every matrix is checked to lie
    /// inside its slice and every size to fit a C `int` before OpenBLAS is called.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm(
        &self,
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        a_layout: Operand,
        b: &[f32],
        b_layout: Operand,
        c: &mut [f32],
        ldc: usize,
    ) -> Result<(), String> {
        // SAFETY: f32 and MaybeUninit<f32> have the same layout, and what is written through the
        // view is f32s (so `c` stays initialised).
        let c = unsafe { &mut *(c as *mut [f32] as *mut [MaybeUninit<f32>]) };
        self.sgemm_uninit((m, n, k), a, a_layout, b, b_layout, c, ldc)
    }

    /// `count` products of `m×k · k×n` into one new buffer of `count·m·n` values, product `i`'s
    /// operands from `operands(i)`: nothing is zeroed first (OpenBLAS writes every value of each
    /// product with β = 0), which saved a pass over every output — 8 % of a gpt-tiny step.
    pub fn sgemm_batch<'x>(
        &self,
        (m, n, k): (usize, usize, usize),
        count: usize,
        (a_layout, b_layout): (Operand, Operand),
        mut operands: impl FnMut(usize) -> Option<(&'x [f32], &'x [f32])>,
    ) -> Result<Vec<f32>, String> {
        let block = m.checked_mul(n).ok_or("m·n overflows")?;
        let total = block.checked_mul(count).ok_or("count·m·n overflows")?;
        let mut out = Vec::<f32>::with_capacity(total);
        let spare = &mut out.spare_capacity_mut()[..total];
        for (i, c) in spare.chunks_exact_mut(block.max(1)).enumerate() {
            let (a, b) =
                operands(i).ok_or_else(|| format!("product {i}'s operands are outside their tensors"))?;
            self.sgemm_uninit((m, n, k), a, a_layout, b, b_layout, c, n.max(1))?;
        }
        // SAFETY: the `count` blocks of `m·n` values tile the first `total` values and each was
        // written whole by `sgemm_uninit` (every value of its m×n matrix, rows `n` apart); with
        // `block == 0` nothing is to be written and `total` is 0.
        unsafe { out.set_len(total) };
        Ok(out)
    }

    /// [`OpenBlas::sgemm`] into a `c` that may be uninitialised: every value of its m×n matrix is
    /// written (OpenBLAS with β = 0 writes without reading; k = 0 writes zeros here).
    #[allow(clippy::too_many_arguments)]
    fn sgemm_uninit(
        &self,
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        a_layout: Operand,
        b: &[f32],
        b_layout: Operand,
        c: &mut [MaybeUninit<f32>],
        ldc: usize,
    ) -> Result<(), String> {
        a_layout.check("a", m, k, a.len())?;
        b_layout.check("b", k, n, b.len())?;
        Operand {
            transposed: false,
            ld: ldc,
        }
        .check("c", m, n, c.len())?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            for row in 0..m {
                c[row * ldc..row * ldc + n].fill(MaybeUninit::new(0.0));
            }
            return Ok(());
        }
        let int = |what: &str, v: usize| {
            c_int::try_from(v).map_err(|_| format!("{what} = {v} does not fit OpenBLAS's 32-bit int"))
        };
        let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
        let (lda, ldb, ldci) = (
            int("lda", a_layout.ld)?,
            int("ldb", b_layout.ld)?,
            int("ldc", ldc)?,
        );
        let trans = |o: Operand| if o.transposed { CBLAS_TRANS } else { CBLAS_NO_TRANS };
        // SAFETY: every matrix was checked above to lie inside its slice (`extent ≤ len`, leading
        // dimensions at least the stored row length), sizes fit `int`, `c` is borrowed mutably and
        // so aliases neither input; OpenBLAS reads `a` and `b` and writes only `c`'s m×n matrix
        // (with β = 0 it does not read `c`, so uninitialised values are never read).
        unsafe {
            (self.sgemm)(
                CBLAS_ROW_MAJOR,
                trans(a_layout),
                trans(b_layout),
                mi,
                ni,
                ki,
                1.0,
                a.as_ptr(),
                lda,
                b.as_ptr(),
                ldb,
                0.0,
                c.as_mut_ptr().cast::<f32>(),
                ldci,
            )
        };
        Ok(())
    }
}

#[cfg(test)]
#[path = "openblas_tests.rs"]
mod tests;
