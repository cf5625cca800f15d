# lit configuration: one test file per pass or feature, checked with FileCheck.
import os
import lit.formats

config.name = "carve"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir", ".test"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.carve_obj_root, "tests", "lit")
config.excludes = ["lit.cfg.py", "lit.site.cfg.py.in"]

config.environment["PATH"] = os.pathsep.join(
    [config.carve_tools_dir, os.path.dirname(config.filecheck), config.environment.get("PATH", "")])
config.substitutions.append(("%models", config.carve_test_models))
config.substitutions.append(("%carve_src", config.carve_src_root))
