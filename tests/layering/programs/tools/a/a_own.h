// A fixture: a tool's own header.
#pragma once
