"""The JVM every node shares: the jars (resolved with Maven once), java, the class-data archive,
the Kafka tools, and the local CA for the SASL_SSL listener."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from services.local_kafka.files import write_private
from services.local_kafka.options import (
    DEPLOY_DIR,
    LIBS_MARKER,
    Options,
    die,
    log,
)


class Jvm:
    """The jars, the java binary and the class-data archive that every node shares."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.vm_id = ""  # java.vm.version, set by check_java

    def _pom_hash(self) -> str:
        return hashlib.sha256((DEPLOY_DIR / "pom.xml").read_bytes()).hexdigest()

    def libs_ready(self) -> bool:
        """The libs dir was filled from this pom, or by hand (KAFKA_LIBS_DIR set, no marker of ours)."""
        libs = self.opts.libs_dir
        marker = libs / LIBS_MARKER
        if marker.is_file() and marker.read_text().strip() == self._pom_hash():
            return True
        return self.opts.libs_dir_given and not marker.is_file() and any(libs.glob("kafka_2.13-*.jar"))

    def fetch(self) -> None:
        """Resolve the jars once with Maven into a fresh sibling dir, then swap it in."""
        if self.libs_ready():
            return
        if shutil.which("mvn") is None:
            die("mvn (Apache Maven) is needed once to download the Kafka jars")
        libs = self.opts.libs_dir
        libs.parent.mkdir(parents=True, exist_ok=True)
        # A failed or interrupted download never leaves a half-filled libs dir, and jars of
        # an older pom (say, a second slf4j-api) never linger next to the new ones.
        tmp = Path(tempfile.mkdtemp(prefix=libs.name + ".fetch.", dir=libs.parent))
        log(f"resolving Kafka jars with Maven into {libs} (once) ...")
        done = subprocess.run(["mvn", "-q", "-B", "-Dstyle.color=never", "-f", str(DEPLOY_DIR / "pom.xml"),  # noqa: S603, S607
                               "dependency:copy-dependencies", "-DincludeScope=runtime",
                               f"-DoutputDirectory={tmp}"], capture_output=True, text=True, check=False)
        # Maven prints stray colour codes even in batch mode.
        sys.stderr.write(re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr))
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            die("mvn dependency:copy-dependencies failed (see the output above)")
        if not any(tmp.glob("kafka_2.13-*.jar")):
            shutil.rmtree(tmp, ignore_errors=True)
            die("no kafka_2.13 jar was resolved")
        (tmp / LIBS_MARKER).write_text(self._pom_hash() + "\n")
        if libs.is_dir():
            if not (libs / LIBS_MARKER).is_file() and any(libs.iterdir()):
                shutil.rmtree(tmp, ignore_errors=True)
                die(f"{libs} exists and was not filled by kafka.sh; refusing to replace it")
            shutil.rmtree(libs)
        tmp.rename(libs)
        # `mvn -f` may leave deploy/kafka/target behind; nothing in it is needed.
        shutil.rmtree(DEPLOY_DIR / "target", ignore_errors=True)
        log(f"jars ready: {sum(1 for _ in libs.rglob('*.jar'))} files")

    def check_java(self) -> None:
        """Kafka 4 needs Java 17+; remember the JVM build for the class-data archive's name."""
        if shutil.which(self.opts.java) is None:
            die("java not found (Kafka 4 needs Java 17 or newer)")
        done = subprocess.run([self.opts.java, "-XshowSettings:properties", "-version"],  # noqa: S603
                              capture_output=True, text=True, check=False)
        settings = done.stdout + done.stderr
        spec = re.search(r"^ *java\.specification\.version = (.*)$", settings, re.M)
        version = spec.group(1).strip() if spec else ""
        major = version.split(".")[0]
        if not (major.isdigit() and int(major) >= 17):
            die(f"Kafka 4 needs Java 17 or newer; {self.opts.java} is {version}")
        vm = re.search(r"^ *java\.vm\.version = (.*)$", settings, re.M)
        self.vm_id = re.sub(r"[^A-Za-z0-9._-]", "_", vm.group(1).strip()) if vm else ""

    @property
    def cds_archive(self) -> Path:
        """The class-data archive of this JVM build (a new fetch drops it with the libs dir)."""
        return self.opts.libs_dir / ".cds" / f"kafka-{self.vm_id}.jsa"

    def cds_opts(self, tag: str) -> tuple[list[str], str]:
        """JVM flags that use the archive, or record it at exit (then also the partial file's path).

        Class-data sharing maps ~6000 Kafka/Scala classes at start instead of loading and
        verifying them one by one (start 5 s -> 3 s on 2 cores).
        """
        quiet = ["-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
        if not self.opts.cds_enabled or not self.vm_id:
            return [], ""
        jsa = self.cds_archive
        if jsa.is_file() and jsa.stat().st_size > 0:
            return [f"-XX:SharedArchiveFile={jsa}", *quiet], ""
        if self.opts.cds in ("on", "1"):
            with contextlib.suppress(OSError):
                jsa.parent.mkdir(parents=True, exist_ok=True)
            if jsa.parent.is_dir() and os.access(jsa.parent, os.W_OK):
                # Unique per run and node: several brokers may record at the same time.
                partial = f"{jsa}.{os.getpid()}{tag}.partial"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                return [f"-XX:ArchiveClassesAtExit={partial}", *quiet], partial
        return [], ""

    def tool(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run one of Kafka's command-line tools (a main class) in a small, quick JVM."""
        opts = ["-Xmx256m", "-XX:TieredStopAtLevel=1"]
        jsa = self.cds_archive
        # The broker's class-data archive holds the tools' classes too.
        if self.opts.cds_enabled and self.vm_id and jsa.is_file() and jsa.stat().st_size > 0:
            opts += [f"-XX:SharedArchiveFile={jsa}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
        return subprocess.run([self.opts.java, *opts, "-cp", f"{self.opts.libs_dir}/*",  # noqa: S603
                               f"-Dlog4j2.configurationFile={DEPLOY_DIR / 'log4j2.properties'}", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)


def ensure_tls(opts: Options) -> None:
    """A local CA and a broker certificate it signs (CN=localhost, SAN DNS:localhost and IP:127.0.0.1).

    Made once with the JDK's keytool. Clients trust ``tls/ca.pem``.
    """
    tls = opts.tls_dir
    if all((tls / name).is_file() for name in ("broker.p12", "ca.pem", "storepass")):
        return
    if shutil.which(opts.keytool) is None:
        die("keytool (from the JDK) is needed for the SASL_SSL listener")
    log(f"creating a local CA and broker certificate in {tls} ...")
    shutil.rmtree(tls, ignore_errors=True)
    tls.mkdir(parents=True)
    tls.chmod(0o700)
    password = re.sub(r"[^A-Za-z0-9]", "", base64.b64encode(os.urandom(24)).decode())
    kt = [opts.keytool, "-noprompt", "-storetype", "PKCS12", "-storepass", password]
    steps = [
        ["-genkeypair", "-keystore", "ca.p12", "-alias", "ca", "-keyalg", "EC", "-groupname", "secp256r1",
         "-dname", "CN=draftstream local CA", "-validity", "3650",
         "-ext", "BasicConstraints:critical=ca:true", "-ext", "KeyUsage:critical=keyCertSign,cRLSign"],
        ["-exportcert", "-rfc", "-keystore", "ca.p12", "-alias", "ca", "-file", "ca.pem"],
        ["-genkeypair", "-keystore", "broker.p12", "-alias", "broker", "-keyalg", "EC", "-groupname", "secp256r1",
         "-dname", "CN=localhost", "-validity", "3650"],
        ["-certreq", "-keystore", "broker.p12", "-alias", "broker", "-file", "broker.csr"],
        ["-gencert", "-keystore", "ca.p12", "-alias", "ca", "-infile", "broker.csr", "-outfile", "broker.pem", "-rfc",
         "-validity", "3650", "-ext", "SubjectAlternativeName=DNS:localhost,IP:127.0.0.1",
         "-ext", "KeyUsage:critical=digitalSignature", "-ext", "ExtendedKeyUsage=serverAuth"],
        ["-importcert", "-keystore", "broker.p12", "-alias", "ca", "-file", "ca.pem"],
        ["-importcert", "-keystore", "broker.p12", "-alias", "broker", "-file", "broker.pem"],
    ]
    with open(opts.run_dir / "keytool.log", "w") as out:  # noqa: PTH123
        for step in steps:
            if subprocess.run([*kt, *step], cwd=tls, stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                              check=False).returncode != 0:
                die(f"keytool failed, see {opts.run_dir / 'keytool.log'}")
    (tls / "broker.csr").unlink(missing_ok=True)
    write_private(tls / "storepass", password + "\n")
